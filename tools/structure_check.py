"""Checks two rules of the code's structure (issue 49) and exits 1 when one is broken:

1. No source file over 600 lines (.rs, .py, .pyi, .cpp, .h, tests included) under router/src,
   server/quiver_server, launcher/src and flags/src; the generated server/quiver_server/pb/ is
   not ours and does not count. A file that size no longer has one job a reader can hold.
2. No import circles: no module imports one that imports it back, directly or through a chain.
   A circle means neither file can be read, tested or moved without the other. One graph with a
   node per file, for the Python packages (server/quiver_server, and bench once bench/__init__.py
   makes it one) and for each Rust crate (router's library and binary, the launcher, flags).

Python edges (ast, so a docstring or a string is never an import):
- `import quiver_server.a.b`, `from quiver_server.a import b` (b a module: an edge to b, else to
  a's `__init__.py`) and relative imports, at module level and inside functions: a function-local
  import still needs the other module, it only hides the circle until the call.
- Imports under `if TYPE_CHECKING:` do not count: they never run.
- A package's `__init__.py` importing its submodules is an edge; a submodule is not an edge to
  its parent `__init__.py` just because Python runs that first: only what the file names counts.

Rust edges (tools/import_graph_rust.py, regular expressions over the code with comments and
literals blanked; the modules found by following `mod x;` from lib.rs / main.rs, `#[path]` too):
- `use crate::…`, `use super::…`, `use self::…` and `use child::…` trees (braces, nested braces,
  `as`, globs), and paths written out in code (`crate::a::b::f()`, `super::x::Y`, `child::f()`,
  or through a module a `use` line named), at any depth of the file.
- A path goes to the deepest module that has a file (`a/b.rs`, `a/b/mod.rs`, `a.rs` with its
  children in `a/`); when the next name is one that module's file imports (`pub use child::Name`,
  `use child::{A, B}`), to the file it comes from: a child naming `super::Thing` depends on the
  file that defines Thing, not on the parent that re-exports it. Through a glob re-export it stays
  at the parent. A name re-exported from another crate is no edge.
- A module and the modules inside it are no edge, either way: in Rust they are one unit (the
  root declares, re-exports and dispatches to its children; they use the types it holds, as
  `super::ParsedOutput`). Circles are looked for between files that are not each other's
  ancestors, e.g. two siblings, where one really could be read without the other.
- Test code is left out: `*_tests.rs`, `tests.rs`, `test_support.rs`, modules declared under
  `#[cfg(test)]`, and `#[cfg(test)]` items inside a file (`mod tests { … }`): a test naturally
  imports what it tests.
- An inline module (`mod pb { … }`, the generated gRPC code) is a node of its own, named
  `main.rs::pb`: a path into it does not depend on the file around it. What its body imports
  counts for that file.

Usage: python3 tools/structure_check.py [--root DIR] [--python-root DIR ...]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from pathlib import Path

from import_graph_rust import Graph, rust_import_graph

MAX_LINES = 600
LENGTH_CHECKED_DIRS = ("router/src", "server/quiver_server", "launcher/src", "flags/src")
GENERATED_DIRS = ("server/quiver_server/pb",)
SOURCE_SUFFIXES = (".rs", ".py", ".pyi", ".cpp", ".h", ".cu", ".cuh")
RUST_SRC_DIRS = ("router/src", "launcher/src", "flags/src")


def default_python_roots(root: Path) -> list[Path]:
    roots = [root / "server/quiver_server"]
    if (root / "bench/__init__.py").exists():
        roots.append(root / "bench")
    return roots


def long_files(root: Path) -> list[tuple[Path, int]]:
    generated = [root / d for d in GENERATED_DIRS]
    found = []
    for folder in LENGTH_CHECKED_DIRS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SOURCE_SUFFIXES or any(path.is_relative_to(g) for g in generated):
                continue
            lines = len(path.read_text(encoding="utf-8", errors="replace").splitlines())
            if lines > MAX_LINES:
                found.append((path, lines))
    return found


def python_modules(package_dirs: list[Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages."""
    modules = {}
    for package_dir in package_dirs:
        for path in sorted(package_dir.rglob("*.py")):
            parts = path.relative_to(package_dir.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class ImportCollector(ast.NodeVisitor):
    """Every import statement of a file, function-local ones included, except under TYPE_CHECKING:
    (line, names of the modules it needs) where a name may be a module's or one of its items'."""

    def __init__(self, module: str, is_package: bool):
        self.package = module.split(".") if is_package else module.split(".")[:-1]
        self.found: list[tuple[int, list[str]]] = []

    def visit_If(self, node: ast.If) -> None:
        if is_type_checking(node.test):
            for statement in node.orelse:
                self.visit(statement)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node.lineno, [alias.name for alias in node.names]))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module.split(".") if node.module else []
        if node.level:
            base = self.package[: len(self.package) - (node.level - 1)] + base
        # `from a import b` needs module a.b if there is one, else module a (for its item b).
        self.found.append((node.lineno, [".".join(base + [alias.name]) for alias in node.names]))


def deepest_module(name: str, modules: dict[str, Path]) -> Path | None:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in modules:
            return modules[".".join(parts[:k])]
    return None


def python_import_graph(package_dirs: list[Path]) -> Graph:
    modules = python_modules(package_dirs)
    graph: Graph = {}
    for module, path in modules.items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        collector = ImportCollector(module, path.name == "__init__.py")
        collector.visit(ast.parse(source, str(path)))
        imports = graph.setdefault(path, {})
        for line, names in collector.found:
            for name in names:
                target = deepest_module(name, modules)
                if target is not None and target != path:
                    imports.setdefault(target, (line, lines[line - 1].strip()))
    return graph


def strongly_connected(graph: Graph) -> list[list[Path]]:
    """Tarjan's algorithm: the groups of files that all reach each other."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    groups: list[list[Path]] = []

    def visit(node: Path) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, {}):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            groups.append(group)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def shortest_path(graph: Graph, start: Path, goal: Path, allowed: set[Path]) -> list[Path]:
    previous: dict[Path, Path | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            break
        for successor in sorted(graph.get(node, {})):
            if successor in allowed and successor not in previous:
                previous[successor] = node
                queue.append(successor)
    path: list[Path] = []
    node_or_none: Path | None = goal
    while node_or_none is not None:
        path.append(node_or_none)
        node_or_none = previous[node_or_none]
    return path[::-1]


def import_circles(graph: Graph) -> list[list[Path]]:
    """For each import inside a group of files that reach each other, the shortest circle through
    it: every import that takes part in a circle is shown, each circle once."""
    circles: dict[tuple[Path, ...], list[Path]] = {}
    for group in strongly_connected(graph):
        members = set(group)
        for source in group:
            for target in graph[source]:
                if target in members:
                    circle = [source] + shortest_path(graph, target, source, members)[:-1]
                    first = circle.index(min(circle))
                    circle = circle[first:] + circle[:first]
                    circles.setdefault(tuple(circle), circle)
    return sorted(circles.values(), key=lambda c: (len(c), c))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="repository root")
    parser.add_argument(
        "--python-root",
        type=Path,
        action="append",
        help="a Python package folder, relative to --root (repeat; default: server/quiver_server, and bench "
        "if it has an __init__.py)",
    )
    args = parser.parse_args()
    root = args.root.resolve()
    python_roots = [root / p for p in args.python_root] if args.python_root else default_python_roots(root)

    def shown(path: Path) -> str:
        return str(path.relative_to(root))

    too_long = long_files(root)
    for path, lines in too_long:
        print(f"too long: {shown(path)}: {lines} lines (at most {MAX_LINES})")

    graph = python_import_graph(python_roots)
    for src in RUST_SRC_DIRS:
        graph.update(rust_import_graph(root / src))
    circles = import_circles(graph)
    for circle in circles:
        print("import circle: " + " -> ".join(shown(p) for p in circle + circle[:1]))
        for source, target in zip(circle, circle[1:] + circle[:1], strict=True):
            line, text = graph[source][target]
            print(f"    {shown(source)}:{line}: {text}")

    if too_long or circles:
        print(f"structure: files over {MAX_LINES} lines: {len(too_long)}, import circles: {len(circles)}")
        return 1
    print(f"structure: no source file over {MAX_LINES} lines, no import circles among {len(graph)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
