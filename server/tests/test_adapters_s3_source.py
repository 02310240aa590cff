"""S3 adapters (`s3://bucket/prefix`) against the real S3 API: moto's server on loopback with IAM
authentication on, reached through a proxy that records (and can hold or corrupt) what the shard
asks for. The references: the files peft's save_pretrained wrote, and the same adapter read from
its local directory. The disk cache's budget and eviction: test_adapters_s3_disk_cache.py."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import grpc
import pytest
from quiver_server.adapters.errors import AdapterNotFoundError, AdapterStoreError
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.pb import shard_pb2
from s3_adapter_fixtures import (
    BUCKET,
    CONFIG,
    MAX_RANK,
    NEW_TOKENS,
    PROMPT,
    WEIGHTS,
    Shard,
    assert_same_weights,
    files_under,
    registry_for,
)
from s3_store import S3Store, StoreProxy
from shard_harness import generate_greedy
from tiny_adapters import assert_greedy_matches, build_adapter, peft_reference, reference_greedy

# The shared fixtures (base model, adapters, the S3 store, the shard), by name.
pytest_plugins = ["s3_adapter_fixtures"]


def test_an_s3_adapter_is_the_adapter_its_directory_holds(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy, tmp_path: Path
) -> None:
    store.upload_dir(BUCKET, "team/sql-v1", adapters["first"])
    registry = registry_for(spec)
    info = registry.load(f"s3://{BUCKET}/team/sql-v1", "s3", "", "")
    registry.load("local", "local", str(adapters["first"]), "")
    assert_same_weights(registry, f"s3://{BUCKET}/team/sql-v1", "local")

    # The files an adapter directory holds, byte for byte; not the checkpoint, README or training state.
    downloaded = Path(info.path)
    source = files_under(adapters["first"])
    kept = [CONFIG, WEIGHTS, "chat_template.jinja", "additional_chat_templates/tools.jinja"]
    assert files_under(downloaded) == {name: source[name] for name in kept}
    assert sorted(proxy.object_gets) == sorted(f"{BUCKET}/team/sql-v1/{name}" for name in kept)
    assert downloaded.parent == (tmp_path / "cache" / "s3" / BUCKET / "team" / "sql-v1").resolve()


def test_an_unchanged_adapter_is_read_from_the_cache(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy
) -> None:
    store.upload_dir(BUCKET, "cached", adapters["first"])
    adapter_id = f"s3://{BUCKET}/cached"
    first = registry_for(spec).load(adapter_id, "s3", "", "")
    downloads = len(proxy.object_gets)
    assert downloads > 0
    # A new process (a fresh registry) and an unload + load in the same one: listed, not downloaded.
    registry = registry_for(spec)
    assert registry.load(adapter_id, "s3", "", "").path == first.path
    registry.forget(adapter_id)
    assert registry.load(adapter_id, "s3", "", "").path == first.path
    assert len(proxy.object_gets) == downloads


def test_a_reuploaded_adapter_is_downloaded_again(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy
) -> None:
    adapter_id = f"s3://{BUCKET}/reuploaded"
    store.upload_dir(BUCKET, "reuploaded", adapters["first"])
    registry = registry_for(spec)
    old = registry.load(adapter_id, "s3", "", "")
    registry.forget(adapter_id)
    store.upload_dir(BUCKET, "reuploaded", adapters["second"])
    gets_before = len(proxy.object_gets)
    new = registry.load(adapter_id, "s3", "", "")
    assert new.path != old.path
    assert f"{BUCKET}/reuploaded/{WEIGHTS}" in proxy.object_gets[gets_before:]
    registry.load("second", "local", str(adapters["second"]), "")
    assert_same_weights(registry, adapter_id, "second")


def test_another_rank_reads_rank_0_s_download(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy, tmp_path: Path
) -> None:
    adapter_id = f"s3://{BUCKET}/ranks"
    store.upload_dir(BUCKET, "ranks", adapters["first"])
    rank0 = registry_for(spec)
    path = rank0.load(adapter_id, "s3", "", "").path
    requests = len(proxy.requests)
    rank1 = registry_for(spec)
    assert rank1.load(adapter_id, "s3", path, "").path == path
    assert len(proxy.requests) == requests  # nothing asked of the store
    rank1.load("local", "local", str(adapters["first"]), "")
    assert_same_weights(rank1, adapter_id, "local")
    # A directory that is not that adapter's place in the cache is refused.
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(path, elsewhere)
    with pytest.raises(ValueError, match="not where this server's cache keeps that S3 adapter"):
        registry_for(spec).load(adapter_id, "s3", str(elsewhere), "")
    with pytest.raises(ValueError, match="not where this server's cache keeps that S3 adapter"):
        registry_for(spec).load(f"s3://{BUCKET}/other", "s3", path, "")


def test_a_missing_adapter_is_not_found(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy
) -> None:
    store.put(BUCKET, "readme-only/README.md", b"# no adapter here")
    registry = registry_for(spec, buckets=(BUCKET, "no-such-bucket"))
    for adapter_id in (f"s3://{BUCKET}/nothing/here", f"s3://{BUCKET}/readme-only", "s3://no-such-bucket/a"):
        with pytest.raises(AdapterNotFoundError):
            registry.load(adapter_id, "s3", "", "")
        assert adapter_id not in registry
    assert proxy.object_gets == []


def test_an_oversized_file_is_refused_before_its_download(
    spec: BaseModelSpec, base_dir: Path, store: S3Store, proxy: StoreProxy, tmp_path: Path
) -> None:
    # The largest adapter of rank MAX_RANK this base serves, in float32: every projection of
    # every layer, A [r, in] and B [out, r] (peft's own all-linear adapter of that rank).
    largest = build_adapter(base_dir, tmp_path / "largest", seed=3, r=MAX_RANK, lora_alpha=16,
                            target_modules="all-linear")
    store.upload_dir(BUCKET, "largest", largest)
    registry = registry_for(spec)
    assert registry.load(f"s3://{BUCKET}/largest", "s3", "", "").rank == MAX_RANK
    too_big = (largest / WEIGHTS).stat().st_size + 2 * 2**20  # past any header allowance too
    store.put(BUCKET, "huge/adapter_config.json", (largest / CONFIG).read_bytes())
    store.put(BUCKET, f"huge/{WEIGHTS}", bytes(too_big))
    store.put(BUCKET, "huge-tokenizer/adapter_config.json", (largest / CONFIG).read_bytes())
    store.put(BUCKET, f"huge-tokenizer/{WEIGHTS}", (largest / WEIGHTS).read_bytes())
    store.put(BUCKET, "huge-tokenizer/tokenizer.json", bytes(64 * 2**20 + 1))
    gets = len(proxy.object_gets)
    with pytest.raises(ValueError, match=rf"^{WEIGHTS} is \d+\.\d MiB, more than any adapter of rank up to "
                                         rf"{MAX_RANK} for this model can be \(\d+\.\d MiB\)$"):
        registry.load(f"s3://{BUCKET}/huge", "s3", "", "")
    with pytest.raises(ValueError, match=r"^tokenizer.json is 64.0 MiB, more than an adapter's tokenizer, template "
                                         r"or config file may be \(64.0 MiB\)$"):
        registry.load(f"s3://{BUCKET}/huge-tokenizer", "s3", "", "")
    assert proxy.object_gets[gets:] == []  # refused from the listing: nothing downloaded


@pytest.mark.parametrize("adapter_id, problem", [
    (f"s3://{BUCKET}/a/../b", "'.' or '..' components"),
    (f"s3://{BUCKET}/a//b", "empty, '.' or '..' components"),
    (f"s3://{BUCKET}/./a", "'.' or '..' components"),
    (f"s3://{BUCKET}/a/", "empty, '.' or '..' components"),
    (f"s3://{BUCKET}/..", "'.' or '..' components"),
    (f"s3://{BUCKET}/", "the prefix is missing"),
    (f"s3://{BUCKET}", "the prefix is missing"),
    (f"s3://{BUCKET}/a\\b", "must not contain '\\'"),
    (f"s3://{BUCKET}/a\nb", "control characters"),
    (f"s3://{BUCKET}/a\x00b", "control characters"),
    (f"s3://{BUCKET}/{'x' * 255}", "more than 254 bytes"),
    ("s3://Quiver_Adapters/a", "bucket name"),
    ("s3://ab/a", "bucket name"),
    ("s3://quiver..adapters/a", "no '..'"),
], ids=["dotdot", "empty", "dot", "trailing-slash", "only-dotdot", "slash-only", "no-prefix", "backslash", "newline",
        "nul", "long-component", "bucket-case", "bucket-short", "bucket-dots"])
def test_malformed_ids_are_refused_before_any_request(
    spec: BaseModelSpec, proxy: StoreProxy, adapter_id: str, problem: str
) -> None:
    with pytest.raises(ValueError, match="S3 adapter ids are s3://bucket/prefix") as raised:
        registry_for(spec).load(adapter_id, "s3", "", "")
    assert problem in str(raised.value)
    assert proxy.requests == []


def test_buckets_not_allowed_are_refused_before_any_request(spec: BaseModelSpec, proxy: StoreProxy) -> None:
    with pytest.raises(ValueError, match="bucket 'other-bucket' is not one this server loads adapters from"):
        registry_for(spec).load("s3://other-bucket/a", "s3", "", "")
    with pytest.raises(ValueError, match=r"S3 adapters are not enabled on this server \(--s3-adapter-buckets\)"):
        registry_for(spec, buckets=()).load(f"s3://{BUCKET}/a", "s3", "", "")
    with pytest.raises(ValueError, match="S3 adapters have no revisions"):
        registry_for(spec).load(f"s3://{BUCKET}/a", "s3", "", "v2")
    assert proxy.requests == []


@pytest.mark.parametrize("wrong, code", [
    ("secret", "SignatureDoesNotMatch"), ("key-id", "InvalidAccessKeyId"), ("session-token", "InvalidToken"),
])
def test_refused_credentials_are_a_store_error_that_never_shows_them(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, wrong: str, code: str
) -> None:
    store.upload_dir(BUCKET, "guarded", adapters["first"])
    secret = "WRONG-secret-0123456789abcdefghijklmnopqrstu" if wrong == "secret" else store.secret_access_key
    key_id = "AKIAWRONGKEYID0000000" if wrong == "key-id" else store.access_key_id
    env = store.server_env(proxy.endpoint, secret=secret, access_key_id=key_id, config_dir=tmp_path / "aws")
    if wrong == "session-token":
        env["AWS_SESSION_TOKEN"] = "WRONG-session-token-zyxwvutsrqponmlk"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    caplog.set_level(logging.INFO)
    with pytest.raises(AdapterStoreError, match="the object store refused the server's credentials") as raised:
        registry_for(spec).load(f"s3://{BUCKET}/guarded", "s3", "", "")
    assert f"({code})" in str(raised.value)
    # Neither chained nor logged: botocore's exception text is the store's, not ours to show.
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    for shown in (str(raised.value), caplog.text):
        for credential in (env["AWS_SECRET_ACCESS_KEY"], env.get("AWS_SESSION_TOKEN"), store.secret_access_key):
            assert credential is None or credential not in shown
    assert code in caplog.text  # the operator's log names the store's answer
    assert proxy.object_gets == []


def test_no_credentials_at_all(spec: BaseModelSpec, proxy: StoreProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    # No instance role to find either (the metadata service is off).
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(AdapterStoreError, match=r"refused the server's credentials .*\(NoCredentialsError"):
        registry_for(spec).load(f"s3://{BUCKET}/a", "s3", "", "")
    assert proxy.requests == []


def test_a_corrupted_download_is_refused_and_nothing_is_kept(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy, tmp_path: Path
) -> None:
    store.upload_dir(BUCKET, "corrupted", adapters["first"])
    proxy.corrupt.add(f"{BUCKET}/corrupted/{WEIGHTS}")
    registry = registry_for(spec)
    with pytest.raises(AdapterStoreError, match=rf"the download of {WEIGHTS} from s3://{BUCKET}/corrupted was "
                                                r"corrupt: .* MD5"):
        registry.load(f"s3://{BUCKET}/corrupted", "s3", "", "")
    folder = tmp_path / "cache" / "s3" / BUCKET / "corrupted"
    assert not folder.exists() or list(folder.iterdir()) == []  # no version, no staging left behind
    proxy.corrupt.clear()
    info = registry.load(f"s3://{BUCKET}/corrupted", "s3", "", "")
    assert (Path(info.path) / WEIGHTS).read_bytes() == (adapters["first"] / WEIGHTS).read_bytes()


def test_concurrent_first_loads_download_once(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy
) -> None:
    adapter_id = f"s3://{BUCKET}/concurrent"
    etags = store.upload_dir(BUCKET, "concurrent", adapters["first"])
    registry = registry_for(spec)
    proxy.hold_objects()
    results: dict[int, str] = {}

    def load(index: int) -> None:
        results[index] = registry.load(adapter_id, "s3", "", "").path

    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    threads[0].start()
    proxy.wait_held(1)  # the first load is downloading; the others start meanwhile
    for thread in threads[1:]:
        thread.start()
    proxy.release()
    for thread in threads:
        thread.join(timeout=120)
    assert len(set(results.values())) == 1 and len(results) == 3
    downloaded = [name for name in etags if proxy.gets_of(f"{BUCKET}/concurrent/{name}")]
    assert all(proxy.gets_of(f"{BUCKET}/concurrent/{name}") == 1 for name in downloaded)


def test_two_processes_downloading_one_version_keep_one_complete_copy(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy
) -> None:
    """Two registries (as two shard processes sharing the cache) download at once; each write is
    staged and renamed into place, so the loser reads the winner's complete copy."""
    adapter_id = f"s3://{BUCKET}/two-processes"
    store.upload_dir(BUCKET, "two-processes", adapters["first"])
    proxy.hold_objects()
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def load(index: int) -> None:
        try:
            results[index] = registry_for(spec).load(adapter_id, "s3", "", "").path
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    proxy.wait_held(2)  # both are downloading
    proxy.release()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert results[0] == results[1]
    folder = Path(results[0]).parent
    assert [p.name for p in folder.iterdir()] == [Path(results[0]).name]  # no staging left behind
    registry = registry_for(spec)
    registry.load(adapter_id, "s3", results[0], "")
    registry.load("local", "local", str(adapters["first"]), "")
    assert_same_weights(registry, adapter_id, "local")


# ---- the disk cache's budget (--adapter-disk-cache-gib) -------------------------------------------


# ---- over gRPC, as the router calls the shard ----------------------------------------------------


def _load(shard: Shard, adapter_id: str) -> shard_pb2.LoadAdapterResponse:
    return shard.stub.LoadAdapter(shard_pb2.LoadAdapterRequest(adapter_id=adapter_id, source="s3"))


def _refused(shard: Shard, adapter_id: str, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as raised:
        _load(shard, adapter_id)
    assert raised.value.code() == code, raised.value.details()
    return raised.value.details()


def test_over_grpc_an_s3_adapter_generates_peft_s_tokens(
    shard: Shard, base_dir: Path, adapters: dict[str, Path], store: S3Store
) -> None:
    adapter_id = f"s3://{BUCKET}/grpc/served"
    store.upload_dir(BUCKET, "grpc/served", adapters["second"])
    loaded = _load(shard, adapter_id)
    assert (loaded.rank, list(loaded.target_modules)) == (8, ["q_proj", "v_proj"])
    shard.stub.ActivateAdapter(shard_pb2.ActivateAdapterRequest(adapter_id=adapter_id, slot=0))
    want = reference_greedy(peft_reference(base_dir, adapters["second"]), PROMPT, NEW_TOKENS)
    assert_greedy_matches(generate_greedy(shard.stub, shard.pool, 1, adapter_id, PROMPT, NEW_TOKENS), want,
                          adapter_id)


def test_over_grpc_each_failure_has_the_status_the_router_maps(
    shard: Shard, adapters: dict[str, Path], store: S3Store
) -> None:
    assert "no adapter under" in _refused(shard, f"s3://{BUCKET}/grpc/missing", grpc.StatusCode.NOT_FOUND)
    assert "not one this server loads" in _refused(shard, "s3://elsewhere/a", grpc.StatusCode.INVALID_ARGUMENT)
    assert "'..'" in _refused(shard, f"s3://{BUCKET}/a/../b", grpc.StatusCode.INVALID_ARGUMENT)
    store.upload_dir(BUCKET, "grpc/corrupt", adapters["first"])
    shard.proxy.corrupt.add(f"{BUCKET}/grpc/corrupt/{WEIGHTS}")
    details = _refused(shard, f"s3://{BUCKET}/grpc/corrupt", grpc.StatusCode.INTERNAL)
    assert details == (f"LoadAdapter failed: the download of {WEIGHTS} from s3://{BUCKET}/grpc/corrupt was corrupt: "
                       "the bytes that arrived do not have the MD5 its ETag says")


def test_over_grpc_a_slow_store_does_not_hold_up_steps(
    shard: Shard, adapters: dict[str, Path], store: S3Store
) -> None:
    """A download held by the store: the base model's steps go on meanwhile, the load ends after."""
    store.upload_dir(BUCKET, "grpc/slow", adapters["first"])
    shard.proxy.hold_objects()
    try:
        pending = shard.stub.LoadAdapter.future(
            shard_pb2.LoadAdapterRequest(adapter_id=f"s3://{BUCKET}/grpc/slow", source="s3"))
        shard.proxy.wait_held()
        assert len(generate_greedy(shard.stub, shard.pool, 2, "", PROMPT, NEW_TOKENS)) == NEW_TOKENS
        assert not pending.done()
    finally:
        shard.proxy.release()
    assert pending.result(timeout=120).rank == 8


def test_serve_takes_the_s3_buckets(capsys: pytest.CaptureFixture[str]) -> None:
    from quiver_server.cli import build_parser

    serve = ["serve", "some/model", "--uds-path", "/tmp/x.sock"]
    assert build_parser().parse_args(serve).s3_adapter_buckets == ()
    parsed = build_parser().parse_args([*serve, "--s3-adapter-buckets", "team-a,shared.adapters"])
    assert parsed.s3_adapter_buckets == ("team-a", "shared.adapters")
    with pytest.raises(SystemExit):
        build_parser().parse_args([*serve, "--s3-adapter-buckets", "team-a,Team_B"])
    assert "'Team_B' is not a bucket name" in capsys.readouterr().err


def test_serve_takes_the_adapter_disk_cache_budget(capsys: pytest.CaptureFixture[str]) -> None:
    from quiver_server.cli import build_parser

    serve = ["serve", "some/model", "--uds-path", "/tmp/x.sock"]
    assert build_parser().parse_args(serve).adapter_disk_cache_gib == 0.0
    assert build_parser().parse_args([*serve, "--adapter-disk-cache-gib", "2.5"]).adapter_disk_cache_gib == 2.5
    for wrong in ("-1", "nan", "inf", "lots"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*serve, "--adapter-disk-cache-gib", wrong])
        assert "--adapter-disk-cache-gib" in capsys.readouterr().err
