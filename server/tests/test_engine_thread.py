"""The shard's engine thread: the model load and every engine call of the gRPC service run on the
same one thread (engine_thread.py says why), and errors come back to the caller."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from shard_harness import BlockPool, greedy_request, running_shard
from tiny_models import build_tiny_model

from quiver_server.engine.engine import Engine
from quiver_server.engine.engine_thread import EngineThread
from quiver_server.pb import shard_pb2
from quiver_server.service import ShardService


def test_calls_run_in_order_on_one_thread_other_than_the_callers() -> None:
    thread = EngineThread()
    try:
        seen: list[int] = []

        def record(value: int) -> int:
            seen.append(threading.get_ident())
            return value * 2

        assert thread.call(record, 1) == 2
        assert asyncio.run(thread.run(record, 2)) == 4
        other = threading.Thread(target=thread.call, args=(record, 3))
        other.start()
        other.join()
        assert len(seen) == 3 and len(set(seen)) == 1
        assert seen[0] != threading.get_ident()
    finally:
        thread.shutdown()


def test_exceptions_reach_the_caller() -> None:
    thread = EngineThread()
    try:
        def fail() -> None:
            raise ValueError("bad request")

        with pytest.raises(ValueError, match="bad request"):
            thread.call(fail)
        with pytest.raises(ValueError, match="bad request"):
            asyncio.run(thread.run(fail))
        assert thread.call(lambda: "still serving") == "still serving"
    finally:
        thread.shutdown()


def test_the_service_steps_on_the_thread_that_loaded_the_model(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    build_tiny_model(model_dir, "llama")
    thread = EngineThread()
    engine = thread.call(Engine, str(model_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    loader_thread = thread.call(threading.get_ident)
    calls: list[tuple[str, int]] = []
    for name in ("warmup", "prefill", "decode", "filter_batch"):
        method = getattr(engine, name)

        def traced(*args, _method=method, _name=name):
            calls.append((_name, threading.get_ident()))
            return _method(*args)

        setattr(engine, name, traced)
    service = ShardService(engine, engine_thread=thread)
    with running_shard(service, tmp_path / "shard.sock") as stub:
        warm = stub.Warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=32, max_total_tokens=32,
                                                   max_batch_size=2))
        pool = BlockPool(warm.block_size, warm.num_blocks)
        stub.Prefill(shard_pb2.PrefillRequest(batch_id=1, requests=[greedy_request(1, [1, 5, 9], 3, pool)]))
        stub.Decode(shard_pb2.DecodeRequest(batches=[shard_pb2.CachedBatch(id=1, request_ids=[1])]))
        stub.FilterBatch(shard_pb2.FilterBatchRequest(batch_id=1, request_ids=[]))
    assert [name for name, _ in calls] == ["warmup", "prefill", "decode", "filter_batch"]
    assert {ident for _, ident in calls} == {loader_thread}
