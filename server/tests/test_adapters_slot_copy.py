"""Slot copies on CPU: equal to a plain copy, and no ATen op over ATen's parallel grain (so
the slot-copy thread never opens an OpenMP team of its own beside the engine's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quiver_server.adapters import slot_copy

ATEN_GRAIN = 32768  # at::internal::GRAIN_SIZE: larger elementwise ops run as a parallel region


class LargestWrite(TorchDispatchMode):
    """Records the most elements any copy_/zero_ wrote in one op."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.zero_.default):
            self.largest = max(self.largest, args[0].numel())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", [(3, 64, 576), (1, 1536, 64), (8, 16, 2048), (1, 1, 40000)])
def test_pieces_equal_a_plain_copy_and_stay_under_the_grain(shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    src = torch.randn(*shape, generator=generator)
    # Slot buffers are views: a rank slice of A, and B's transposed CPU layout.
    storage = torch.zeros(shape[0], shape[2], shape[1] + 5)
    dst = storage.transpose(1, 2)[:, : shape[1]]
    with LargestWrite() as mode:
        slot_copy.copy_into(dst, src)
    assert torch.equal(dst, src)
    assert not storage.transpose(1, 2)[:, shape[1]:].any()
    assert 0 < mode.largest <= slot_copy.SERIAL_ELEMENTS < ATEN_GRAIN
    with LargestWrite() as mode:
        slot_copy.zero(dst)
    assert not storage.any()
    assert 0 < mode.largest <= slot_copy.SERIAL_ELEMENTS
