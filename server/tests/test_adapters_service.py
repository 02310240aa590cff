"""The adapter RPCs over real gRPC: LoadAdapter, ActivateAdapter, Prefill/Decode with an
adapter (equal to peft's greedy output), UnloadAdapter, and the statuses of bad calls."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from shard_harness import BlockPool, generate_greedy, greedy_request, running_shard
from tiny_adapters import assert_greedy_matches, build_adapter, peft_reference, reference_greedy
from tiny_models import build_tiny_model

from quiver_server.bounded_text import MAX_MESSAGE_BYTES
from quiver_server.engine.engine import Engine
from quiver_server.pb import shard_pb2, shard_pb2_grpc
from quiver_server.service import ShardService

NEW_TOKENS = 6
PROMPT = [9, 80, 41, 7, 230, 15, 66]
MAX_RANK = 16


@dataclass
class Shard:
    stub: shard_pb2_grpc.ShardStub
    pool: BlockPool
    base_dir: Path
    adapters: dict[str, Path]
    engine: Engine
    service: ShardService


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shard]:
    base_dir = build_tiny_model(tmp_path_factory.mktemp("base"), "llama", seed=6)
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        "qv": build_adapter(base_dir, root / "qv", seed=1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "mlp": build_adapter(base_dir, root / "mlp", seed=2, r=16, lora_alpha=8, use_rslora=True,
                             target_modules=["gate_proj", "up_proj", "down_proj"]),
        "too-big": build_adapter(base_dir, root / "too-big", seed=3, r=32, target_modules=["q_proj"]),
    }
    engine = Engine(str(base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    socket_path = tmp_path_factory.mktemp("sock") / "shard.sock"
    service = ShardService(engine)
    with running_shard(service, socket_path) as stub:
        warm = stub.Warmup(shard_pb2.WarmupRequest(
            max_batch_prefill_tokens=64, max_total_tokens=64, max_batch_size=4,
            max_active_adapters=2, max_lora_rank=MAX_RANK,
        ))
        yield Shard(stub, BlockPool(warm.block_size, warm.num_blocks), base_dir, adapters, engine, service)


def _status(code: grpc.StatusCode, call, request) -> str:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as raised:
        call(request)
    assert raised.value.code() == code, raised.value.details()
    return raised.value.details()


def _generate(shard: Shard, batch_id: int, adapter_id: str) -> list[int]:
    return generate_greedy(shard.stub, shard.pool, batch_id, adapter_id, PROMPT, NEW_TOKENS)


def test_load_activate_generate_unload(shard: Shard) -> None:
    stub = shard.stub
    qv = str(shard.adapters["qv"])
    loaded = stub.LoadAdapter(shard_pb2.LoadAdapterRequest(adapter_id="qv", source="local", path=qv))
    assert (loaded.rank, loaded.scaling, list(loaded.target_modules)) == (8, 2.0, ["q_proj", "v_proj"])
    assert Path(loaded.path) == shard.adapters["qv"].resolve()
    # A hub adapter on a rank other than 0 arrives with rank 0's download directory.
    mlp = stub.LoadAdapter(shard_pb2.LoadAdapterRequest(
        adapter_id="owner/mlp", source="hub", path=str(shard.adapters["mlp"]), revision="main"
    ))
    assert mlp.scaling == pytest.approx(8 / 16**0.5)

    stub.ActivateAdapter(shard_pb2.ActivateAdapterRequest(adapter_id="qv", slot=0))
    stub.ActivateAdapter(shard_pb2.ActivateAdapterRequest(adapter_id="owner/mlp", slot=1))
    for batch_id, (adapter_id, kind) in enumerate([("qv", "qv"), ("owner/mlp", "mlp"), ("", None)]):
        reference = peft_reference(shard.base_dir, None if kind is None else shard.adapters[kind])
        expected = reference_greedy(reference, PROMPT, NEW_TOKENS)
        assert_greedy_matches(_generate(shard, 10 + batch_id, adapter_id), expected, adapter_id or "base")

    stub.UnloadAdapter(shard_pb2.UnloadAdapterRequest(adapter_id="qv"))
    request = greedy_request(1, PROMPT, NEW_TOKENS, shard.pool)
    request.adapter_id = "qv"
    details = _status(grpc.StatusCode.INVALID_ARGUMENT, stub.Prefill,
                      shard_pb2.PrefillRequest(batch_id=20, requests=[request]))
    assert "'qv' is not active" in details


def test_mismatch_is_invalid_argument(shard: Shard) -> None:
    details = _status(
        grpc.StatusCode.INVALID_ARGUMENT, shard.stub.LoadAdapter,
        shard_pb2.LoadAdapterRequest(adapter_id="too-big", source="local", path=str(shard.adapters["too-big"])),
    )
    assert "r=32 exceeds" in details and f"max_lora_rank={MAX_RANK}" in details


def test_missing_directory_is_not_found(shard: Shard, tmp_path: Path) -> None:
    details = _status(
        grpc.StatusCode.NOT_FOUND, shard.stub.LoadAdapter,
        shard_pb2.LoadAdapterRequest(adapter_id="gone", source="local", path=str(tmp_path / "gone")),
    )
    assert "does not exist" in details


def _hostile_copy(shard: Shard, tmp_path: Path, name: str, config_text: str) -> Path:
    """The qv adapter's weights under an adapter_config.json of `config_text`."""
    path = tmp_path / name
    shutil.copytree(shard.adapters["qv"], path)
    (path / "adapter_config.json").write_text(config_text)
    return path


def test_hostile_adapter_configs_are_bounded_refusals(shard: Shard, tmp_path: Path) -> None:
    """Issue 48: 200 long target module names (a 21 KB config) once came back whole in the
    status and broke the router's connection; a config nested 100,000 levels deep raised a
    RecursionError (INTERNAL, a 500). Both are an INVALID_ARGUMENT (400) of a few hundred bytes,
    and the shard goes on serving."""
    config = json.loads((shard.adapters["qv"] / "adapter_config.json").read_text())
    modules = [f"m{i:05d}" + "x" * 94 for i in range(200)]
    long_names = _hostile_copy(shard, tmp_path, "long-names", json.dumps({**config, "target_modules": modules}))
    depth = 100_000
    nested = _hostile_copy(shard, tmp_path, "nested", '{"r": 8, "target_modules": ' + "[" * depth + "]" * depth + "}")
    for path, says in [(long_names, "and 197 more match none"), (nested, "nested too deeply")]:
        details = _status(grpc.StatusCode.INVALID_ARGUMENT, shard.stub.LoadAdapter,
                          shard_pb2.LoadAdapterRequest(adapter_id=path.name, source="local", path=str(path)))
        assert len(details.encode()) <= MAX_MESSAGE_BYTES and says in details, details
    reference = reference_greedy(peft_reference(shard.base_dir, None), PROMPT, NEW_TOKENS)
    assert_greedy_matches(_generate(shard, 50, ""), reference, "base, after the refusals")


def test_bad_activation_is_invalid_argument(shard: Shard) -> None:
    details = _status(grpc.StatusCode.INVALID_ARGUMENT, shard.stub.ActivateAdapter,
                      shard_pb2.ActivateAdapterRequest(adapter_id="never-loaded", slot=0))
    assert "'never-loaded' is not loaded" in details
    qv = str(shard.adapters["qv"])
    shard.stub.LoadAdapter(shard_pb2.LoadAdapterRequest(adapter_id="qv2", source="local", path=qv))
    details = _status(grpc.StatusCode.INVALID_ARGUMENT, shard.stub.ActivateAdapter,
                      shard_pb2.ActivateAdapterRequest(adapter_id="qv2", slot=2))
    assert "slot 2 is out of range" in details


def test_a_slow_load_does_not_hold_up_steps(shard: Shard, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub download can take minutes: the steps of running requests go on meanwhile."""
    entered, release = threading.Event(), threading.Event()
    real_load = shard.engine.lora.load

    def stuck_load(*args: str) -> object:
        entered.set()
        release.wait(60)
        return real_load(*args)

    monkeypatch.setattr(shard.engine.lora, "load", stuck_load)
    pending = shard.stub.LoadAdapter.future(
        shard_pb2.LoadAdapterRequest(adapter_id="slow", source="local", path=str(shard.adapters["qv"]))
    )
    try:
        assert entered.wait(30)
        assert len(_generate(shard, 30, "")) == NEW_TOKENS
        assert not pending.done()
    finally:
        release.set()
    assert pending.result(timeout=60).rank == 8


def test_serve_takes_the_host_cache_size() -> None:
    from quiver_server.cli import build_parser

    serve = ["serve", "some/model", "--uds-path", "/tmp/x.sock"]
    assert build_parser().parse_args(serve).max_cpu_adapters == 64
    assert build_parser().parse_args([*serve, "--max-cpu-adapters", "3"]).max_cpu_adapters == 3


def test_a_slot_copy_runs_beside_the_steps(shard: Shard, monkeypatch: pytest.MonkeyPatch) -> None:
    """ActivateAdapter runs on the slot-copy thread: a base request generates to the end while a
    copy is held up, and the adapter then serves peft's output."""
    stub = shard.stub
    stub.LoadAdapter(shard_pb2.LoadAdapterRequest(adapter_id="beside", source="local",
                                                  path=str(shard.adapters["mlp"])))
    entered, release = threading.Event(), threading.Event()
    slots = shard.engine.lora.slots
    assert slots is not None
    real_activate = slots.activate

    def held_activate(*args: object) -> object:
        entered.set()
        release.wait(60)
        return real_activate(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(slots, "activate", held_activate)
    pending = stub.ActivateAdapter.future(shard_pb2.ActivateAdapterRequest(adapter_id="beside", slot=1))
    try:
        assert entered.wait(30)
        base = reference_greedy(peft_reference(shard.base_dir, None), PROMPT, NEW_TOKENS)
        assert_greedy_matches(_generate(shard, 40, ""), base, "base, beside a slot copy")
        assert not pending.done()
    finally:
        release.set()
    pending.result(timeout=60)
    expected = reference_greedy(peft_reference(shard.base_dir, shard.adapters["mlp"]), PROMPT, NEW_TOKENS)
    assert_greedy_matches(_generate(shard, 41, "beside"), expected, "activated beside the steps")
    stub.UnloadAdapter(shard_pb2.UnloadAdapterRequest(adapter_id="beside"))


def test_prefetch_brings_an_evicted_adapter_back_into_host_memory(shard: Shard) -> None:
    stub = shard.stub
    stub.LoadAdapter(shard_pb2.LoadAdapterRequest(adapter_id="warm", source="local",
                                                  path=str(shard.adapters["qv"])))
    host = shard.engine.lora.registry.host
    host.remove("warm")  # as --max-cpu-adapters would
    assert "warm" not in host
    assert not stub.PrefetchAdapter(shard_pb2.PrefetchAdapterRequest(adapter_id="warm")).host_cache_hit
    assert "warm" in host
    assert stub.PrefetchAdapter(shard_pb2.PrefetchAdapterRequest(adapter_id="warm")).host_cache_hit
    # The slot copy then finds it in host memory.
    assert stub.ActivateAdapter(shard_pb2.ActivateAdapterRequest(adapter_id="warm", slot=1)).host_cache_hit
    details = _status(grpc.StatusCode.INVALID_ARGUMENT, stub.PrefetchAdapter,
                      shard_pb2.PrefetchAdapterRequest(adapter_id="never-loaded"))
    assert "'never-loaded' is not loaded" in details
    stub.UnloadAdapter(shard_pb2.UnloadAdapterRequest(adapter_id="warm"))


def test_only_the_engine_thread_runs_torch_ops_on_a_team(shard: Shard) -> None:
    """The slot copies, loads and grammar compiles run their torch ops on their own thread: a
    second OpenMP team would slow the engine's steps (docs/architecture.md, "Threads")."""
    import torch

    service = shard.service
    for pool in (service._activator, service._loader, service._compiler):
        assert pool.submit(torch.get_num_threads).result(timeout=30) == 1
    assert service._worker.call(torch.get_num_threads) == torch.get_num_threads()
