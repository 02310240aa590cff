"""glibc malloc settings for the serving process: keep freed activation memory for the next step.

A step allocates and frees the same large tensors (activations, logits) every time. Left at its
defaults, glibc hands a thread other than the main one its own arena of 64 MiB heaps, and returns
freed memory at the top of those heaps to the kernel; the next step then takes a page fault for
every 4 KiB it touches again. A CPU decode step of the benchmark model measured 700-1500 minor
faults and ran ~15% slower than with these settings (see docs/benchmarks.md):

- one arena: the engine thread allocates from the main heap, which has no size limit;
- freed memory stays mapped until 1 GiB of it sits unused at the heap's top;
- every block comes from the heap, none from a fresh mmap each time: a prefill's activations
  ([tokens, intermediate_size] floats: 46 MiB for 4096 tokens of the benchmark model) are over
  glibc's largest mmap threshold (32 MiB), and would be faulted in page by page on every prefill.

This must run before the process starts other threads (each thread picks its arena on its first
allocation). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

# mallopt parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

SETTINGS = {
    M_ARENA_MAX: 1,
    M_TRIM_THRESHOLD: 1 << 30,
    M_MMAP_MAX: 0,
}


def keep_freed_memory() -> bool:
    """Applies SETTINGS; True if the C library accepted every one."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        gnu_get_libc_version = libc.gnu_get_libc_version  # glibc only; musl's mallopt is a stub
    except (OSError, AttributeError):
        return False
    gnu_get_libc_version.restype = ctypes.c_char_p
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    accepted = all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
    if not accepted:
        logger.warning("glibc %s refused a malloc setting; step memory may be refaulted",
                       gnu_get_libc_version().decode())
    return accepted
