"""The one thread of a shard that runs torch compute: loading the model, warmup, every step.

Why one thread for all of it, the load included: OpenMP gives each thread that opens a parallel
region a worker team of its own. With the bench model on a 2-core CPU, decode steps run
in-process on a worker thread were 20-35% slower when the main thread had opened one parallel
region before (its team then idle throughout) than when it had not (docs/benchmarks.md). One
thread also keeps CUDA's per-thread current device the same for the load and the steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class EngineThread:
    """A single worker thread; calls run one at a time, in submission order."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quiver-engine")

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Runs `fn` on the thread and waits for it (exceptions propagate)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Runs `fn` on the thread without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        """Waits for the call in progress (if any), then stops the thread."""
        self._executor.shutdown(wait=True)
