"""Each request's stream of uniform draws, computed for a whole batch at once on the device.

Draw n of a request with seed s is SplitMix64's n-th output for s: mix(s + (n + 1) * golden),
with its top 53 bits as a float64 in [0, 1). A counter-based stream needs no generator object
per request and no loop over rows: the batch holds every row's seed and draws-so-far as two
int64 tensors and maps them to uniforms in a handful of element-wise ops, on the CPU or a GPU
alike (integer arithmetic: the same draws everywhere). A preempted request resumes at draw
`draws_done` with nothing to replay.

torch's int64 multiplication wraps modulo 2^64 and `>>` is arithmetic, so the logical shifts
mask the sign bits off; `server/tests/test_sampling.py` holds the stream to a pure-Python
SplitMix64.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB


def as_int64(value: int) -> int:
    """An unsigned 64-bit value (a proto uint64 seed) as the int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(seeds: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """float64 [B] in [0, 1): draw `draws[i]` (0-based) of the stream of seed `seeds[i]`; both
    int64 [B] on one device."""
    z = seeds + (draws + 1) * as_int64(_GOLDEN)
    z = (z ^ _shift_right(z, 30)) * as_int64(_MIX_1)
    z = (z ^ _shift_right(z, 27)) * as_int64(_MIX_2)
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).to(torch.float64) * 2.0**-53
