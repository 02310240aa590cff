"""Which device and dtype a shard serves in, decided without a GPU: `--dtype auto` on CUDA is a
16-bit dtype whatever the checkpoint states, and a CUDA device without an index is the rank's."""

from __future__ import annotations

import pytest
import torch

from quiver_server.device_choice import resolve_device, resolve_dtype

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    "stated,bf16,expected",
    [
        ("float32", True, torch.bfloat16),  # an 8B model saved in float32 would need 32 GB
        (None, True, torch.bfloat16),  # the config names no dtype
        ("bfloat16", True, torch.bfloat16),
        ("float16", True, torch.float16),  # a half checkpoint keeps its own half type
        ("bfloat16", False, torch.float16),  # no bfloat16 on this GPU (before Ampere)
        (None, False, torch.float16),
    ],
)
def test_auto_on_cuda_is_sixteen_bit(stated: str | None, bf16: bool, expected: torch.dtype) -> None:
    config = {"model_type": "llama"} | ({"dtype": stated} if stated else {})
    assert resolve_dtype("auto", config, CUDA, bf16_supported=lambda: bf16) == expected


def test_auto_on_cpu_is_float32_and_names_are_kept() -> None:
    assert resolve_dtype("auto", {"dtype": "bfloat16"}, torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", {}, CUDA, bf16_supported=lambda: True) == torch.float16
    with pytest.raises(ValueError, match="not one of auto"):
        resolve_dtype("float64", {}, CUDA)


def test_a_cuda_device_without_an_index_is_the_local_rank() -> None:
    assert resolve_device("cuda", {"LOCAL_RANK": "3"}) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", {"LOCAL_RANK": "3"}) == torch.device("cuda", 1)
    assert resolve_device("cpu", {"LOCAL_RANK": "3"}) == torch.device("cpu")
