"""The shard's one dispatch point (`kernels/ops.py`): what `select_ops` picks from the device and
the QUIVER_* switches, and that a layer keeps what was picked at load whatever the environment
says later."""

from __future__ import annotations

import pytest
import torch

from quiver_server.engine.forward_batch import build_decode, build_prefill
from quiver_server.kernels import cpu_ops
from quiver_server.kernels.lora_reference import add_lora_reference
from quiver_server.kernels.ops import CpuKernelOps, KernelOps, TritonKernelOps, select_ops
from quiver_server.layers.linear import Linear
from quiver_server.layers.lora import LoraPart, LoraWrapper, with_lora

CPU = torch.device("cpu")


@pytest.mark.cpu_kernels
def test_a_cpu_shard_runs_the_cpp_kernels_where_they_are_built() -> None:
    assert cpu_ops.available()  # make install builds them
    ops = select_ops(CPU)
    assert isinstance(ops, CpuKernelOps)
    assert (ops.lora_backend, ops.packed_matmul) == ("cpu", "quiver")


def test_the_switches_choose_the_torch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUIVER_CPU_KERNELS", "0")
    ops = select_ops(CPU)
    assert type(ops) is KernelOps
    assert (ops.lora_backend, ops.packed_matmul) == ("torch", "onednn")
    monkeypatch.setenv("QUIVER_LORA_BACKEND", "reference")
    assert select_ops(CPU).lora_backend == "reference"
    monkeypatch.setenv("QUIVER_LORA_BACKEND", "cpu")
    with pytest.raises(ValueError, match="C\\+\\+ CPU kernels are not available"):
        select_ops(CPU)
    monkeypatch.setenv("QUIVER_LORA_BACKEND", "bogus")
    with pytest.raises(ValueError, match="unknown LoRA backend"):
        select_ops(CPU)


def _linear_with_an_adapter(ops: KernelOps) -> tuple[LoraWrapper, LoraPart]:
    gen = torch.Generator().manual_seed(0)
    linear = Linear(16, {"q_proj": 8, "k_proj": 4}, bias=False, ops=ops)
    linear.weight.data = torch.randn(12, 16, generator=gen)
    part = LoraPart(
        columns=slice(8, 12),
        lora_a=torch.randn(2, 4, 16, generator=gen),
        lora_b=ops.lora_b_buffer(2, 4, 4, torch.float32).copy_(torch.randn(2, 4, 4, generator=gen)),
        scaling=torch.tensor([0.5, 2.0]),
        ranks=torch.tensor([4, 4], dtype=torch.int32),
        in_use=True,
    )
    unused = LoraPart(slice(0, 8), torch.zeros(2, 4, 16), torch.zeros(2, 8, 4), part.scaling,
                      torch.zeros(2, dtype=torch.int32))
    return with_lora(linear, [[unused, part]]), part


def test_a_layer_keeps_the_lora_backend_chosen_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = KernelOps(CPU, lora_backend="reference", packed_matmul=None)
    linear, part = _linear_with_an_adapter(ops)
    batch = build_prefill([3, 2], torch.arange(2)[:, None], 16, CPU, lora_slots=[1, -1], lora_ranks=4)
    assert batch.lora is not None
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    expected = torch.nn.functional.linear(x, linear.base.weight)
    add_lora_reference(expected, x, part.lora_a, part.lora_b, part.scaling, batch.lora, part.columns)
    with torch.inference_mode():
        first = linear(x, batch)
        # Read once at load: a later environment (even one that would fail to resolve) changes nothing.
        monkeypatch.setenv("QUIVER_LORA_BACKEND", "bogus")
        again = linear(x, batch)
    assert torch.equal(first, expected) and torch.equal(again, expected)


def test_cuda_gets_the_triton_ops_and_no_gather_reserve() -> None:
    ops = select_ops(torch.device("cuda", 0))  # choosing touches no GPU
    assert isinstance(ops, TritonKernelOps) and ops.lora_backend == "triton"
    assert not ops.decode_gathers and KernelOps.decode_gathers


@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 2.0)])
def test_triton_decode_attention_is_the_torch_path_s(window: int | None, softcap: float | None) -> None:
    """The Triton ops' decode attention (here in Triton's CPU interpreter) through the same call
    the attention layer makes, against the plain-torch ops on the same batch."""
    gen = torch.Generator().manual_seed(5)
    lengths = [1, 17, 40]
    table = torch.randperm(12, generator=gen)[:9].view(3, 3)
    k, v = (torch.randn(12, 16, 2, 64, generator=gen) for _ in range(2))
    q = torch.randn(3, 8, 64, generator=gen)
    batch = build_decode([n - 1 for n in lengths], table, 16, CPU)
    triton_ops, torch_ops = TritonKernelOps(CPU, "torch", None), KernelOps(CPU, "torch", None)
    got = triton_ops.decode_attention(q, k, v, batch, 0.125, window, softcap)
    expected = torch_ops.decode_attention(q, k, v, batch, 0.125, window, softcap)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
