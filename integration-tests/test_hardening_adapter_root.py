"""The adapter root is a boundary for files too, errors never show where files are, and adapter
names cannot forge log lines, multiply one adapter or make one adapter answer for another
(docs/security.md). Real launcher, router and shard; real files and symlinks on disk; peft as the
reference for which weights answered.

The root this module serves (its own, under a tmp directory that also holds what lies outside):

    root/ad0, root/ad1            two adapters (different weights)
    root/ad2, root/ad3            copies of ad1, for a long name and a log marker
    root/ad0-link -> ad0          a directory link that stays inside
    root/template-link/           ad1's files, chat_template.jinja -> outside/secret.jinja
    root/tokenizer-link/          ad1's files, tokenizer.json -> outside/tokenizer.json
    root/config-link/             ad1's weights, adapter_config.json -> outside/evil/...
    root/all-links/               every file a link to outside/evil (a valid adapter)
    root/broken-*                 adapters with a malformed file of their own
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

import openai_schema
import reference
from adapter_models import (
    ADAPTER_KINDS,
    MAX_TOKENS,
    SERVED_NAME,
    AdapterSet,
    adapter_set,
    build_adapter,
    completion_ids,
    peft_greedy,
    start_stack,
)

SECRET = "SECRET-OUTSIDE-THE-ROOT"
# What docs/security.md promises for names.
MAX_NAME_BYTES = 256
FORGED = "FORGED-LOG-LINE"


def _copy_adapter(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _link(target: Path, link: Path) -> None:
    link.unlink(missing_ok=True)
    link.symlink_to(target)


def _build(shared: AdapterSet, tmp: Path) -> AdapterSet:
    base = shared.base_dir
    root, outside = tmp / "root", tmp / "outside"
    config = ADAPTER_KINDS["rank8"]
    ad0 = build_adapter(base, root / "ad0", seed=500, **config)
    ad1 = build_adapter(base, root / "ad1", seed=501, **config)
    evil = build_adapter(base, outside / "evil", seed=502, **config)
    for spare in ("ad2", "ad3"):
        _copy_adapter(ad1, root / spare)
    (root / "ad0-link").symlink_to(ad0, target_is_directory=True)

    (outside / "secret.jinja").write_text(SECRET + " {% for m in messages %}{{ m.content }}{% endfor %}")
    _link(outside / "secret.jinja", _copy_adapter(ad1, root / "template-link") / "chat_template.jinja")
    shutil.copy(base / "tokenizer.json", outside / "tokenizer.json")
    _link(outside / "tokenizer.json", _copy_adapter(ad1, root / "tokenizer-link") / "tokenizer.json")
    _link(evil / "adapter_config.json", _copy_adapter(ad1, root / "config-link") / "adapter_config.json")
    (root / "all-links").mkdir()
    for file in evil.iterdir():
        _link(file, root / "all-links" / file.name)

    # Broken files of the adapter's own: JSON errors spread over lines (a parser would say
    # "line 3 column 3"), and a template that is not UTF-8.
    broken_json = '{\n  "bos_token": "<s>",\n  oops\n}\n'
    (_copy_adapter(ad1, root / "broken-tokenizer-config") / "tokenizer_config.json").write_text(broken_json)
    (_copy_adapter(ad1, root / "broken-adapter-config") / "adapter_config.json").write_text(broken_json)
    (_copy_adapter(ad1, root / "broken-template") / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    (_copy_adapter(ad1, root / "broken-tokenizer") / "tokenizer.json").write_text('{\n  "model":\n  [1, 2\n')
    return AdapterSet(base_dir=base, root=root, outside=evil)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> AdapterSet:
    return _build(adapter_set(tmp_path_factory), tmp_path_factory.mktemp("hardening"))


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), "hardening-adapter-root")
    yield stack
    stack.stop()


def _post(stack, path: str, payload: dict) -> tuple[int, dict | str]:
    """POST with JSON; the answer as JSON, or as text (the load endpoints' success is text)."""
    status, raw = stack.post_raw(path, json.dumps(payload).encode())
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def _complete(stack, model: str, **extra) -> tuple[int, dict]:
    return stack.post_json("/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": MAX_TOKENS,
                                               "temperature": 0, "return_token_ids": True, **extra})


def _chat(stack, model: str) -> tuple[int, dict]:
    return stack.post_json("/v1/chat/completions", {"model": model, "max_tokens": 2, "return_token_ids": True,
                                                    "messages": [{"role": "user", "content": "hi"}]})


def _load(stack, name: str, path: str) -> tuple[int, dict | str]:
    return _post(stack, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "adapter_source": "local"})


def _error(status: int, body, want_status: int, code: str, param: str | None = None) -> str:
    """Checks an OpenAI-shaped error; its message."""
    assert status == want_status, (status, body)
    openai_schema.validate(body, "ErrorResponse")
    assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]["message"]


def _no_server_paths(adapters: AdapterSet, body) -> None:
    text = json.dumps(body)
    tmp = adapters.root.parent
    for path in (tmp, tmp.resolve(), adapters.base_dir, adapters.base_dir.resolve()):
        assert str(path) not in text, f"a server path in {text}"


def _listed(stack) -> list[str]:
    status, body = stack.get("/v1/models")
    assert status == 200
    return [card["id"] for card in json.loads(body)["data"]]


def _served_by(adapters: AdapterSet, stack, model: str, adapter_dir_id: str) -> None:
    """`model`'s greedy tokens are peft's for the adapter in root/`adapter_dir_id`."""
    status, body = _complete(stack, model)
    assert status == 200, body
    want = peft_greedy(adapters, adapter_dir_id, completion_ids(adapters, "Hello"))
    reference.assert_greedy_parity(body["choices"][0]["token_ids"], want, f"{model} is {adapter_dir_id}")


# ---- F1: files that lead out of the root -----------------------------------------------------------


@pytest.mark.parametrize("model", ["template-link", "tokenizer-link", "config-link", "all-links"])
def test_adapter_files_linked_out_of_the_root_are_refused(adapters, stack, model):
    for status, body in (_chat(stack, model), _complete(stack, model)):
        message = _error(status, body, 400, "invalid_adapter", "model")
        assert "leads outside" in message, message
        assert SECRET not in json.dumps(body)
        _no_server_paths(adapters, body)
    assert model not in _listed(stack)


def test_links_that_stay_inside_the_root_are_served(adapters, stack):
    _served_by(adapters, stack, "ad1", "ad1")


# ---- F2: no paths and no positions in errors ------------------------------------------------------------


@pytest.mark.parametrize("model, file", [
    ("broken-tokenizer-config", "tokenizer_config.json"),
    ("broken-adapter-config", "adapter_config.json"),
    ("broken-template", "chat_template.jinja"),
    ("broken-tokenizer", "tokenizer.json"),
])
def test_broken_files_are_named_without_paths_or_positions(adapters, stack, model, file):
    status, body = _complete(stack, model)
    message = _error(status, body, 400, "invalid_adapter", "model")
    assert file in message, message
    _no_server_paths(adapters, body)
    lowered = message.lower()
    assert "line " not in lowered and "column" not in lowered and "char " not in lowered, message


# ---- F8: one adapter per directory, no squatting ------------------------------------------------------------


def test_spellings_of_one_directory_are_one_adapter(adapters, stack):
    spellings = ["ad0", "./ad0", "././ad0", "ad0/", ".//ad0/./", "ad0-link"]
    for spelling in spellings:
        _served_by(adapters, stack, spelling, "ad0")
    listed = [model for model in _listed(stack) if model in spellings]
    assert len(listed) == 1, f"one directory loaded {len(listed)} times: {listed}"


def test_a_name_cannot_squat_another_adapter(adapters, stack):
    # `ad1` is the id of root/ad1: loading ad0's files under it would serve ad0 to ad1's clients.
    _error(*_load(stack, "ad1", "ad0"), 409, "adapter_name_conflict", "lora_name")
    # A hub id of someone else's adapter, likewise.
    _error(*_load(stack, "some-org/some-adapter", "ad0"), 409, "adapter_name_conflict", "lora_name")
    # The base model's served name.
    _error(*_load(stack, SERVED_NAME, "ad0"), 400, "invalid_value", "lora_name")
    _served_by(adapters, stack, "ad1", "ad1")


def test_a_directory_is_not_loaded_again_under_a_second_name(adapters, stack):
    assert _load(stack, "ad0", "ad0")[0] == 200
    _error(*_load(stack, "my-copy", "./ad0"), 409, "adapter_name_conflict", "lora_name")
    assert "my-copy" not in _listed(stack)
    # Loading it again under its own name stays a no-op.
    assert _load(stack, "ad0", "ad0-link")[0] == 200


@pytest.mark.parametrize("name", ["x\r\nINFO forged", "x\x00y", "x\x1b[31m", "x\u0085y", "x" * (MAX_NAME_BYTES + 1)])
def test_malformed_names_are_refused_naming_the_field(adapters, stack, name):
    _error(*_load(stack, name, "ad1"), 400, "invalid_adapter_id", "lora_name")
    status, body = _post(stack, "/v1/unload_lora_adapter", {"lora_name": name})
    _error(status, body, 400, "invalid_adapter_id", "lora_name")
    _error(*_complete(stack, name), 400, "invalid_adapter_id", "model")
    assert name not in _listed(stack)


def test_a_name_of_the_longest_length_is_accepted(adapters, stack):
    name = "n" * MAX_NAME_BYTES
    assert _load(stack, name, "ad2") == (200, f"Success: LoRA adapter '{name}' added successfully.")
    assert name in _listed(stack)


# ---- F7: nothing a client sends reaches the launcher's log raw --------------------------------------------


def test_control_characters_never_reach_the_log(adapters, stack):
    name = f"f7\r\n{FORGED}\x00\x1b[2J"
    _load(stack, name, "ad1")
    _complete(stack, name)
    _post(stack, "/v1/unload_lora_adapter", {"lora_name": name})
    # A load after the attempts: once the shard's line about it is in the log, so are theirs.
    marker = "f7-marker"
    assert _load(stack, marker, "ad3")[0] == 200
    deadline = time.monotonic() + 30
    while marker.encode() not in (log := stack.log_path.read_bytes()):
        assert time.monotonic() < deadline, "the load never reached the launcher log"
        time.sleep(0.1)
    for raw in (b"\r", b"\x00", b"\x1b"):
        assert raw not in log, f"raw {raw!r} in the launcher log"
    assert not any(line.lstrip().startswith(FORGED.encode()) for line in log.split(b"\n")), "a forged log line"
