"""The file-level import graph of one Rust crate, for tools/structure_check.py (its docstring has
the rules and why). Read with regular expressions over source whose comments and literals are
blanked first, so that a path in a doc comment or a string is never taken for an import: no Rust
parser is needed, and the crate does not have to build."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# file -> imported file -> (line, source text) of the first import seen.
Graph = dict[Path, dict[Path, tuple[int, str]]]
ModulePath = tuple[str, ...]

TEST_FILE_NAMES = ("tests.rs", "test_support.rs")
ROOT_FILE_NAMES = ("mod.rs", "lib.rs", "main.rs")

ATTRIBUTE = re.compile(r"#\[[^\]]*\]")
CFG_TEST = re.compile(r"#\[\s*cfg\s*\(\s*test\s*\)\s*\]")
MOD_DECLARATION = re.compile(r"((?:#\[[^\]]*\]\s*)*)(?:pub(?:\s*\([^)]*\))?\s+)?\bmod\s+(\w+)\s*([;{])")
PATH_ATTRIBUTE = re.compile(r'#\[\s*path\s*=\s*"([^"]*)"\s*\]')
USE_STATEMENT = re.compile(r"(?<![\w$])(pub(?:\s*\([^)]*\))?\s+)?\buse\s+([^;]*);")
USE_TOKEN = re.compile(r"::|[{},*]|\w+")
RAW_STRING_START = re.compile(r'b?r(#*)"')


def blank_comments_and_literals(source: str) -> str:
    """The source with comments and the insides of string and char literals turned into spaces,
    newlines kept: offsets and line numbers stay those of the file."""
    out = list(source)
    n = len(source)
    i = 0

    def blank(start: int, end: int) -> None:
        for k in range(start, min(end, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = source[i]
        if source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            blank(i, end)
            i = end
        elif source.startswith("/*", i):
            depth, k = 1, i + 2
            while k < n and depth:
                if source.startswith("/*", k):
                    depth, k = depth + 1, k + 2
                elif source.startswith("*/", k):
                    depth, k = depth - 1, k + 2
                else:
                    k += 1
            blank(i, k)
            i = k
        elif c in "br" and (raw := RAW_STRING_START.match(source, i)):
            if i and (source[i - 1].isalnum() or source[i - 1] == "_"):
                i += 1  # an identifier ending in `r` or `br`, not a raw string
                continue
            closing = '"' + raw.group(1)
            start = raw.end()
            end = source.find(closing, start)
            end = n if end < 0 else end
            blank(start, end)
            i = end + len(closing)
        elif c == '"':
            k = i + 1
            while k < n and source[k] != '"':
                k += 2 if source[k] == "\\" else 1
            blank(i + 1, k)
            i = k + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{e9}') or a lifetime ('a, 'static): only the literal
            # closes with a quote right after its one character or its escape.
            if source.startswith("\\", i + 1):
                k = source.find("'", i + 3)
                k = n if k < 0 else k
                blank(i + 1, k)
                i = k + 1
            elif i + 2 < n and source[i + 2] == "'":
                blank(i + 1, i + 2)
                i += 3
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def matching_brace(code: str, open_at: int) -> int:
    """The offset just past the `}` that closes the `{` at open_at (literals already blanked)."""
    depth = 0
    for k in range(open_at, len(code)):
        if code[k] == "{":
            depth += 1
        elif code[k] == "}":
            depth -= 1
            if depth == 0:
                return k + 1
    return len(code)


def blank_test_items(code: str) -> str:
    """The code without the items marked `#[cfg(test)]` (inline `mod tests { ... }`, test-only
    `use` lines and helpers): an item runs to its first `;` or to the brace that closes its
    first `{`, whichever comes first."""
    out = list(code)
    for marker in CFG_TEST.finditer(code):
        k = marker.end()
        while k < len(code) and code[k] not in ";{":
            k += 1
        end = matching_brace(code, k) if k < len(code) and code[k] == "{" else k + 1
        for j in range(marker.start(), min(end, len(code))):
            if out[j] != "\n":
                out[j] = " "
    return "".join(out)


def line_of(code: str, offset: int) -> int:
    return code.count("\n", 0, offset) + 1


@dataclass
class UseLeaf:
    """One name a `use` tree brings in: `use a::{b::C as D, e::*}` has two leaves."""

    segments: list[str]
    name: str  # the name bound in the file ("*" for a glob)
    offset: int  # of the leaf's last segment, for its line number


def use_tree_leaves(tree: str, offset: int) -> list[UseLeaf]:
    """The leaves of a `use` tree's text (the part between `use` and `;`), at offset in the file."""
    tokens = [(m.group(), offset + m.start()) for m in USE_TOKEN.finditer(tree)]
    leaves: list[UseLeaf] = []

    def parse(i: int, prefix: list[str]) -> int:
        segments = list(prefix)
        while i < len(tokens):
            token, at = tokens[i]
            if token == "{":
                i += 1
                while i < len(tokens) and tokens[i][0] != "}":
                    i = parse(i, segments)
                    if i < len(tokens) and tokens[i][0] == ",":
                        i += 1
                return i + 1
            if token == "*":
                leaves.append(UseLeaf(segments, "*", at))
                return i + 1
            if token == "::":  # a leading `::` (an external crate) or a stray separator
                i += 1
                continue
            segments.append(token)
            i += 1
            if i < len(tokens) and tokens[i][0] == "::":
                i += 1
                continue
            name = segments[-1]
            if i + 1 < len(tokens) and tokens[i][0] == "as":
                name = tokens[i + 1][0]
                i += 2
            if segments[-1] == "self":  # `a::{self, ...}` names the module a itself
                segments = segments[:-1]
                name = name if name != "self" else (segments[-1] if segments else "self")
            leaves.append(UseLeaf(segments, name, at))
            return i
        return i

    i = 0
    while i < len(tokens):
        i = parse(i, [])
        if i < len(tokens) and tokens[i][0] == ",":
            i += 1
    return leaves


@dataclass
class SourceFile:
    """A module's file and what its code says, for resolving the paths that point into it."""

    path: Path
    module: ModulePath
    is_test: bool
    source: str = ""
    code: str = ""  # comments and literals blanked, test items removed
    children: dict[str, Path] = field(default_factory=dict)  # `mod x;` declared here
    # Names its top-level `use` lines bind: name -> absolute path in the crate, None if external.
    bindings: dict[str, ModulePath | None] = field(default_factory=dict)

    @property
    def is_module_root(self) -> bool:
        return bool(self.children)


def is_test_file(path: Path) -> bool:
    return path.name in TEST_FILE_NAMES or path.name.endswith("_tests.rs")


def child_directory(path: Path) -> Path:
    """Where `mod x;` in this file looks for x: beside mod.rs/lib.rs/main.rs, else in a folder
    named after the file (`tokenizer.rs` -> `tokenizer/`)."""
    return path.parent if path.name in ROOT_FILE_NAMES else path.parent / path.stem


class Crate:
    """The modules of the crate whose root file (lib.rs or main.rs) is given, found by following
    its `mod x;` declarations."""

    def __init__(self, root_file: Path):
        self.files: dict[ModulePath, SourceFile] = {}
        self._load(root_file, (), is_test=False)
        for source_file in self.files.values():
            self._read_bindings(source_file)

    def _load(self, path: Path, module: ModulePath, is_test: bool) -> None:
        source = path.read_text(encoding="utf-8")
        blanked = blank_comments_and_literals(source)
        source_file = SourceFile(path, module, is_test or is_test_file(path), source, blank_test_items(blanked))
        self.files[module] = source_file
        for declaration in MOD_DECLARATION.finditer(blanked):
            attributes, name, terminator = declaration.groups()
            if terminator == "{":
                if not CFG_TEST.search(attributes):
                    # An inline module (`mod pb { include_proto!(..) }`) is a node of its own, so a
                    # path into it does not make its file a dependency; what it imports, its file does.
                    inline = SourceFile(Path(f"{path}::{name}"), module + (name,), source_file.is_test)
                    self.files[inline.module] = inline
                continue
            explicit = PATH_ATTRIBUTE.search(source, declaration.start(1), declaration.end(1))
            if explicit:
                child = path.parent / explicit.group(1)
            else:
                folder = child_directory(path)
                child = folder / f"{name}.rs"
                if not child.exists():
                    child = folder / name / "mod.rs"
            if child.exists():
                source_file.children[name] = child
                self._load(child, module + (name,), source_file.is_test or bool(CFG_TEST.search(attributes)))

    def _read_bindings(self, source_file: SourceFile) -> None:
        code = source_file.code
        for use in USE_STATEMENT.finditer(code):
            if brace_depth(code, use.start()) != 0:
                continue  # a `use` inside a function binds nothing for other modules
            for leaf in use_tree_leaves(use.group(2), use.start(2)):
                if leaf.name != "*":
                    source_file.bindings[leaf.name] = self.absolute(leaf.segments, source_file, {})

    def absolute(
        self, segments: list[str], source_file: SourceFile, module_aliases: dict[str, ModulePath]
    ) -> ModulePath | None:
        """A path as written in source_file, from the crate's root; None if it leaves the crate."""
        if not segments:
            return None
        first, rest = segments[0], tuple(segments[1:])
        if first == "crate":
            return rest
        if first == "self":
            return source_file.module + rest
        if first == "super":
            ups = 0
            while ups < len(segments) and segments[ups] == "super":
                ups += 1
            if ups > len(source_file.module):
                return None
            return source_file.module[: len(source_file.module) - ups] + tuple(segments[ups:])
        if first in source_file.children:
            return source_file.module + tuple(segments)
        if first in module_aliases:
            return module_aliases[first] + rest
        return None

    def resolve(self, path: ModulePath, hops: int = 0) -> SourceFile | None:
        """The file that defines what the path names: its deepest module with a file, or, when
        the next name is one that module's file imports (`pub use child::Name`), where that one
        comes from. None when it comes from another crate."""
        depth = max(k for k in range(len(path) + 1) if path[:k] in self.files)
        module = self.files[path[:depth]]
        if depth < len(path) and hops < 8 and path[depth] in module.bindings:
            target = module.bindings[path[depth]]
            return None if target is None else self.resolve(target + path[depth + 1 :], hops + 1)
        return module

    def graph(self) -> Graph:
        graph: Graph = {}
        for source_file in self.files.values():
            if not source_file.is_test:
                graph[source_file.path] = self._imports_of(source_file)
        return graph

    def _imports_of(self, source_file: SourceFile) -> dict[Path, tuple[int, str]]:
        code, lines = source_file.code, source_file.source.splitlines()
        imports: dict[Path, tuple[int, str]] = {}
        module_aliases: dict[str, ModulePath] = {}

        def add(path: ModulePath | None, offset: int) -> None:
            target = None if path is None else self.resolve(path)
            if target is None or target.path == source_file.path:
                return
            # A module and the modules inside it are one unit in Rust: the parent declares,
            # re-exports and dispatches to its children, and they use the types it holds
            # (`super::ParsedOutput`). Only files that are not each other's ancestors can form
            # a circle worth breaking.
            mine, theirs = source_file.module, target.module
            if theirs[: len(mine)] == mine or mine[: len(theirs)] == theirs:
                return
            line = line_of(code, offset)
            imports.setdefault(target.path, (line, lines[line - 1].strip()))

        code_only = list(code)
        for use in USE_STATEMENT.finditer(code):
            for leaf in use_tree_leaves(use.group(2), use.start(2)):
                path = self.absolute(leaf.segments, source_file, module_aliases)
                if path is not None and path in self.files and leaf.name != "*":
                    module_aliases[leaf.name] = path
                add(path, leaf.offset)
            code_only[use.start() : use.end()] = " " * (use.end() - use.start())
        names = {"crate", "super", "self", *source_file.children, *module_aliases}
        qualified = re.compile(rf"(?<![\w$:])(?:{'|'.join(sorted(names))})(?:::\w+)+")
        for path_match in qualified.finditer("".join(code_only)):
            segments = path_match.group().split("::")
            add(self.absolute(segments, source_file, module_aliases), path_match.start())
        return imports


def brace_depth(code: str, offset: int) -> int:
    return code.count("{", 0, offset) - code.count("}", 0, offset)


def crate_roots(src: Path) -> list[Path]:
    """A src folder's crates: the library and the binary are separate crates."""
    return [src / name for name in ("lib.rs", "main.rs") if (src / name).exists()]


def rust_import_graph(src: Path) -> Graph:
    graph: Graph = {}
    for root_file in crate_roots(src):
        graph.update(Crate(root_file).graph())
    return graph
