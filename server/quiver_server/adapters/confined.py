"""Reading an adapter's files without leaving the tree the operator chose for it.

A client picks adapters by name, and an adapter directory may hold symlinks: a file linked out
of the adapter root would be read on a client's say-so. So each file is opened first and then
checked where the opened file really is (`/proc/self/fd/N`), which no swap of a link between a
check and the open can fool; the bytes read are those of that same open file. Messages name
only the file within the adapter, never a server path.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from quiver_server.adapters.size_limits import SizeLimit

log = logging.getLogger(__name__)


class OutsideRootError(ValueError):
    """A file (or directory) of an adapter resolves outside its root."""


def hub_cache_repo(directory: Path) -> Path | None:
    """`.../models--org--name` for a Hugging Face cache snapshot `.../models--org--name/snapshots/<rev>`.

    A snapshot's files are links into the repository's `blobs/`, so that folder is their root.
    """
    snapshots = directory.parent
    repo = snapshots.parent
    if snapshots.name == "snapshots" and repo.name.startswith("models--"):
        return repo
    return None


def is_inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def read_confined(directory: Path, name: str, root: Path, limit: SizeLimit | None = None) -> bytes | None:
    """The bytes of `directory/name`, None if it does not exist; refused unless the opened file lies in `root`,
    and, with a `limit`, when the opened file is larger (before any of it is read).

    `root` must be canonical (`Path.resolve()`).
    """
    path = directory / name
    try:
        # Non-blocking, so a FIFO in place of a file cannot hang the loader at open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as error:
        log.warning("cannot open %s: %s", path, error)
        raise ValueError(f"{name} cannot be read ({error.strerror})") from None
    try:
        opened = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if not is_inside(opened, root):
            log.warning("refused %s: it resolves to %s, outside %s", path, opened, root)
            raise OutsideRootError(f"{name} leads outside the adapter root")
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"{name} is not a regular file")
        if limit is not None:
            limit.check(name, status.st_size)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read()
    finally:
        os.close(fd)
