"""What the S3 adapter tests share: a tiny base model and two adapters of it, moto's S3 server on
loopback with IAM authentication on (reached through a recording proxy), the shard's environment
pointed at it, a gRPC shard reading adapters from the bucket, and a registry as warmup leaves it.
The fixtures are imported by the test modules that use them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from shard_harness import BlockPool, running_shard
from tiny_adapters import build_adapter
from tiny_models import build_tiny_model

from quiver_server.adapters.registry import AdapterRegistry
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.engine.engine import Engine
from quiver_server.pb import shard_pb2, shard_pb2_grpc
from quiver_server.service import ShardService

sys.path.append(str(Path(__file__).resolve().parents[2] / "integration-tests"))
from s3_store import AWS_VARIABLES_TO_CLEAR, S3Store, StoreProxy, start_store  # noqa: E402

BUCKET = "quiver-adapters"
MAX_RANK = 16
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
PROMPT = [9, 80, 41, 7, 230, 15, 66]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("base"), "llama", seed=5)


@pytest.fixture(scope="module")
def spec(base_dir: Path) -> BaseModelSpec:
    return Engine(str(base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01).lora.spec


@pytest.fixture(scope="module")
def adapters(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of one shape with other weights (the second is the first "re-uploaded"); the
    first with a chat template, an extra template, and files an adapter directory does not hold."""
    root = tmp_path_factory.mktemp("adapters")
    qv = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    first = build_adapter(base_dir, root / "first", seed=1, **qv)
    (first / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (first / "additional_chat_templates").mkdir()
    (first / "additional_chat_templates" / "tools.jinja").write_text("{{ tools }}")
    (first / "checkpoint-10").mkdir()
    (first / "checkpoint-10" / WEIGHTS).write_bytes((first / WEIGHTS).read_bytes())
    (first / "training_args.bin").write_bytes(b"not an adapter file")
    return {"first": first, "second": build_adapter(base_dir, root / "second", seed=2, **qv)}


@pytest.fixture(scope="module")
def store() -> Iterator[S3Store]:
    store = start_store()
    store.create_bucket(BUCKET)
    yield store
    store.stop()


def point_at(store: S3Store, proxy: StoreProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard's AWS_* environment (the store through `proxy`) and its adapter cache."""
    for name in AWS_VARIABLES_TO_CLEAR:
        monkeypatch.delenv(name, raising=False)
    for name, value in store.server_env(proxy.endpoint, config_dir=tmp_path / "aws").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("QUIVER_ADAPTER_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def proxy(store: S3Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StoreProxy:
    proxy = store.proxy()
    point_at(store, proxy, tmp_path, monkeypatch)
    return proxy


@dataclass
class Shard:
    stub: shard_pb2_grpc.ShardStub
    pool: BlockPool
    proxy: StoreProxy


@pytest.fixture(scope="module")
def shard(base_dir: Path, store: S3Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shard]:
    """The gRPC shard, with S3 adapters from BUCKET, one adapter slot."""
    proxy = store.proxy()
    with pytest.MonkeyPatch.context() as monkeypatch:
        point_at(store, proxy, tmp_path_factory.mktemp("shard"), monkeypatch)
        engine = Engine(str(base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01,
                        s3_adapter_buckets=(BUCKET,))
        with running_shard(ShardService(engine), tmp_path_factory.mktemp("sock") / "shard.sock") as stub:
            warm = stub.Warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=64, max_total_tokens=64,
                                                       max_batch_size=4, max_active_adapters=1,
                                                       max_lora_rank=MAX_RANK))
            yield Shard(stub, BlockPool(warm.block_size, warm.num_blocks), proxy)


def registry_for(spec: BaseModelSpec, buckets: tuple[str, ...] = (BUCKET,), adapter_root: Path | None = None,
              disk_cache_bytes: int = 0, max_cpu_adapters: int = 8) -> AdapterRegistry:
    """A shard's adapter registry, as warmup leaves it (slots of rank up to MAX_RANK)."""
    registry = AdapterRegistry(spec, torch.float32, torch.device("cpu"), max_cpu_adapters=max_cpu_adapters,
                               adapter_root=str(adapter_root) if adapter_root else None, s3_buckets=buckets,
                               disk_cache_bytes=disk_cache_bytes)
    registry.max_rank = MAX_RANK
    return registry


def assert_same_weights(registry: AdapterRegistry, got_id: str, want_id: str) -> None:
    got, want = registry.get(got_id), registry.get(want_id)
    assert (got.rank, got.scaling, got.target_modules) == (want.rank, want.scaling, want.target_modules)
    assert got.weights.keys() == want.weights.keys()
    for key, (a, b) in want.weights.items():
        assert torch.equal(got.weights[key][0], a) and torch.equal(got.weights[key][1], b), key


def files_under(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}
