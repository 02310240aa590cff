"""Hub adapters are confined to their repository's folder in the Hugging Face cache: a snapshot's
files are links into the repository's `blobs/` (served), but a file linked anywhere else is
refused (docs/security.md). An offline cache laid out as huggingface_hub lays it out; the real
stack; peft as the reference for the served weights."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import openai_schema
import reference
from adapter_models import (
    ADAPTER_KINDS,
    MAX_TOKENS,
    AdapterSet,
    adapter_set,
    build_adapter,
    completion_ids,
    peft_greedy,
    start_stack,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SECRET = "SECRET-OUTSIDE-THE-CACHE"


def _cached_repo(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """`repo`'s snapshot in the cache: each file a relative link into `blobs/`, as the hub client
    writes it; a file whose source is a link already keeps pointing where that link points."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    for name, source in files.items():
        if source.is_symlink():
            (snapshot / name).symlink_to(source.readlink())
            continue
        blob = hashlib.sha256(source.read_bytes()).hexdigest()
        (storage / "blobs" / blob).write_bytes(source.read_bytes())
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    shared = adapter_set(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("hub-hardening")
    adapter = build_adapter(shared.base_dir, tmp / "made" / "good", seed=600, **ADAPTER_KINDS["rank8"])
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "secret.jinja").write_text(SECRET)
    (tmp / "links").mkdir()
    (tmp / "links" / "config").symlink_to(adapter / "adapter_config.json")
    (tmp / "links" / "template").symlink_to(outside / "secret.jinja")
    cache = tmp / "cache"
    weights = {name: adapter / name for name in ("adapter_config.json", "adapter_model.safetensors")}
    good = _cached_repo(cache, "org/good", weights)
    _cached_repo(cache, "org/leaky-config", {**weights, "adapter_config.json": tmp / "links" / "config"})
    _cached_repo(cache, "org/leaky-template", {**weights, "chat_template.jinja": tmp / "links" / "template"})
    # The reference reads the snapshot by its commit; the stack gets an adapter root of its own.
    return cache, AdapterSet(base_dir=shared.base_dir, root=good.parent, outside=outside), tmp / "local-root"


@pytest.fixture(scope="module")
def stack(hub, tmp_path_factory):
    cache, adapters, local_root = hub
    local_root.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        # The stack inherits the environment: the shards read this cache, offline.
        patch.setitem(os.environ, "HF_HUB_CACHE", str(cache))
        patch.setitem(os.environ, "HF_HUB_OFFLINE", "1")
        served = AdapterSet(base_dir=adapters.base_dir, root=local_root, outside=adapters.outside)
        stack = start_stack(served, tmp_path_factory.mktemp("logs"), "hardening-hub-cache")
    yield stack
    stack.stop()


def _complete(stack, model: str) -> tuple[int, dict]:
    return stack.post_json("/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": MAX_TOKENS,
                                               "temperature": 0, "return_token_ids": True, "adapter_source": "hub"})


def test_a_cached_hub_adapter_reads_its_blobs(hub, stack):
    _, adapters, _ = hub
    status, body = _complete(stack, "org/good")
    assert status == 200, body
    want = peft_greedy(adapters, COMMIT, completion_ids(adapters, "Hello"))
    reference.assert_greedy_parity(body["choices"][0]["token_ids"], want, "org/good from the cache")


@pytest.mark.parametrize("model, file", [
    ("org/leaky-config", "adapter_config.json"),
    ("org/leaky-template", "chat_template.jinja"),
])
def test_a_cached_file_linked_out_of_its_repository_is_refused(hub, stack, model, file):
    cache, _, _ = hub
    status, body = _complete(stack, model)
    assert status == 400, body
    openai_schema.validate(body, "ErrorResponse")
    assert body["error"]["code"] == "invalid_adapter", body
    message = body["error"]["message"]
    assert file in message and "leads outside" in message, message
    text = json.dumps(body)
    assert SECRET not in text and str(cache.parent) not in text, text
