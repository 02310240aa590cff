"""A directory written in full before anyone sees it: files go into a temporary sibling, which is
renamed into place at the end, so a reader that finds the directory (the launcher checking its
cache) always finds it complete. Used by the demo and the tiny model writers."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_staged(target_dir: str | os.PathLike[str], fill: Callable[[Path], None]) -> Path:
    """Runs `fill(staging)` and renames the staging directory to `target_dir`, which must not
    exist or be empty; nothing is left behind if `fill` fails. Returns the resolved target."""
    target = Path(target_dir).expanduser().resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target} already exists and is not an empty directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(staging)
        _apply_umask(staging)
        if target.exists():
            target.rmdir()
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _apply_umask(root: Path) -> None:
    """mkdtemp (and safetensors) create owner-only files; give them the usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
