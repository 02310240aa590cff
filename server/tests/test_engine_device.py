"""Which device and dtype a shard serves in, decided without a GPU: `--dtype auto` on CUDA is a
16-bit dtype whatever the checkpoint states; on CPU bfloat16 only for a bfloat16 checkpoint on a
CPU that multiplies bfloat16 in hardware; a CUDA device without an index is the rank's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quiver_server.device_choice import cpu_multiplies_bfloat16, resolve_device, resolve_dtype

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


@pytest.mark.parametrize(
    "stated,hardware_bf16,expected",
    [
        ("bfloat16", True, torch.bfloat16),  # AMX or AVX512-BF16: the checkpoint's own
        ("bfloat16", False, torch.float32),  # AVX2: bfloat16 arithmetic is emulated, ~5x slower
        ("float16", True, torch.float32),  # bfloat16 would round float16's mantissa
        ("float32", True, torch.float32),
        (None, True, torch.float32),
    ],
)
def test_auto_on_cpu_is_bfloat16_only_for_a_bfloat16_checkpoint_on_bfloat16_hardware(
        stated: str | None, hardware_bf16: bool, expected: torch.dtype) -> None:
    config = {"model_type": "llama"} | ({"dtype": stated} if stated else {})
    assert resolve_dtype("auto", config, torch.device("cpu"), cpu_bf16=lambda: hardware_bf16) == expected


def test_this_hosts_bfloat16_hardware_is_read_from_its_cpu_flags() -> None:
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    assert cpu_multiplies_bfloat16() == bool(flags & {"amx_bf16", "avx512_bf16"})


def test_names_are_kept() -> None:
    assert resolve_dtype("float32", {"dtype": "bfloat16"}, torch.device("cpu"), cpu_bf16=lambda: True) == torch.float32
    assert resolve_dtype("float16", {}, CUDA, bf16_supported=lambda: True) == torch.float16
    with pytest.raises(ValueError, match="not one of auto"):
        resolve_dtype("float64", {}, CUDA)


def test_a_cuda_device_without_an_index_is_the_local_rank() -> None:
    assert resolve_device("cuda", {"LOCAL_RANK": "3"}) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", {"LOCAL_RANK": "3"}) == torch.device("cuda", 1)
    assert resolve_device("cpu", {"LOCAL_RANK": "3"}) == torch.device("cpu")
