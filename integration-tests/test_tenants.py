"""`--api-keys-file`: per-key isolation on every endpoint that names a model (chat, completions,
tokenize, detokenize, models, load, unload) for allowed, forbidden, unknown and admin keys; a
forbidden adapter answers exactly as a missing one; per-key limits give 429 with Retry-After;
/metrics, which names every adapter and key, only for admin keys; per-key counters in /metrics
(read with prometheus_client's parser); SIGHUP reloads the file while a streamed request runs on
to its end."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import openai
import pytest
from openai.types import CompletionUsage
from prometheus_client.parser import text_string_to_metric_families

import openai_schema
from adapter_models import ADAPTER_KINDS, BASE_SEED, build_adapter
from conftest import SHARD_ENV
from model_builders import build_model_dir
from stack import Stack, StackConfig
from tenant_keys import (ALICE, BOB, KEYS, METER, NEWCOMER, OPS, RPM, SERVED_NAME, SOLO, STREAMER, TEAM_A,
                         TEAM_A_EXTRA, TEAM_B, TPM, UNKNOWN_KEY, Caller, call, endpoint_calls, poll,
                         without_id, write_keys_file)

STARTUP_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    write_keys_file(path, KEYS)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, keys_file) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("tenants")
    base = build_model_dir("llama", tmp / "base", seed=BASE_SEED)
    root = tmp / "root"
    for seed, adapter_id in enumerate([TEAM_A, TEAM_A_EXTRA, TEAM_B], start=500):
        build_adapter(base, root / adapter_id, seed=seed, **ADAPTER_KINDS["rank8"])
    config = StackConfig(
        model_id=str(base), served_model_name=SERVED_NAME, max_input_tokens=256, max_total_tokens=512,
        extra_args=["--adapter-source", "local", "--adapter-root", str(root),
                    "--preload-adapters", f"{TEAM_A},{TEAM_B}", "--api-keys-file", str(keys_file)],
        extra_env=SHARD_ENV)
    # A shared 2-core machine can take minutes to load the shard.
    stack = Stack(config, tmp / "tenants.log").start(timeout_s=STARTUP_TIMEOUT_S)
    try:
        yield stack
        log = stack.log()
        for key in [*KEYS, NEWCOMER]:
            assert key.key not in log, f"{key.name}'s key was logged"
    finally:
        stack.stop()


def sdk(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture
def callers(stack) -> Iterator[dict[str, Caller]]:
    callers = {name: Caller(stack.base_url, key)
               for name, key in [("alice", ALICE.key), ("bob", BOB.key), ("ops", OPS.key),
                                 ("unknown", UNKNOWN_KEY)]}
    yield callers
    for caller in callers.values():
        caller.close()


def listed(caller: Caller) -> list[str]:
    response = caller.get("/v1/models")
    assert response.status_code == 200, response.text
    openai_schema.validate(response.json(), "ListModelsResponse")
    return [card["id"] for card in response.json()["data"]]


def test_models_lists_only_what_each_key_may_use(stack):
    with sdk(stack, ALICE.key) as alice, sdk(stack, BOB.key) as bob, sdk(stack, OPS.key) as ops:
        assert [m.id for m in alice.models.list()] == [SERVED_NAME, TEAM_A]
        assert [m.id for m in bob.models.list()] == [TEAM_B]
        assert [m.id for m in ops.models.list()] == [SERVED_NAME, TEAM_A, TEAM_B]
        assert alice.models.retrieve(TEAM_A).id == TEAM_A
        with pytest.raises(openai.NotFoundError):
            alice.models.retrieve(TEAM_B)
        with pytest.raises(openai.NotFoundError):
            bob.models.retrieve(SERVED_NAME)
    with sdk(stack, UNKNOWN_KEY) as nobody, pytest.raises(openai.AuthenticationError):
        nobody.models.list()


@pytest.mark.parametrize("endpoint", [name for name, *_ in endpoint_calls("x")])
def test_every_endpoint_isolates_keys(stack, callers, endpoint):
    def answer(who: str, model: str):
        [(_, method, path, body)] = [c for c in endpoint_calls(model) if c[0] == endpoint]
        return call(callers[who], method, path, body)

    # Allowed: alice on her adapter and the base model, ops on everything.
    for who, model in [("alice", TEAM_A), ("alice", SERVED_NAME), ("ops", TEAM_B), ("bob", TEAM_B)]:
        response = answer(who, model)
        assert response.status_code == 200, (who, model, response.text)
    # Forbidden (loaded, on disk but not loaded, the base model) answers exactly as a missing
    # adapter does, for a key whose patterns let the lookup happen.
    missing = without_id(answer("alice", "team-a/missing"), "team-a/missing")
    assert missing[0] == 404 and '"code":"model_not_found"' in missing[1], missing
    openai_schema.validate(answer("alice", "team-a/missing").json(), "ErrorResponse")
    for who, model in [("bob", TEAM_A), ("bob", TEAM_A_EXTRA), ("alice", TEAM_B), ("bob", SERVED_NAME)]:
        assert without_id(answer(who, model), model) == missing, (who, model)
    # Unknown key.
    for model in [TEAM_A, SERVED_NAME]:
        response = answer("unknown", model)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    # Asking for a forbidden adapter never loaded it.
    assert TEAM_A_EXTRA not in listed(callers["ops"])


def test_sdk_sees_a_forbidden_adapter_as_missing(stack):
    with sdk(stack, BOB.key) as bob, sdk(stack, ALICE.key) as alice:
        with pytest.raises(openai.NotFoundError) as forbidden:
            bob.chat.completions.create(model=TEAM_A, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.NotFoundError) as missing:
            alice.chat.completions.create(model="team-a/nope", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2)
        with pytest.raises(openai.NotFoundError) as forbidden_completion:
            bob.completions.create(model=TEAM_A, prompt="hi", max_tokens=2)
    forbidden_body = forbidden.value.response.text.replace(TEAM_A, "<ID>")
    assert forbidden_body == missing.value.response.text.replace("team-a/nope", "<ID>")
    assert forbidden_completion.value.response.text == forbidden.value.response.text
    assert forbidden.value.code == "model_not_found"


def test_load_and_unload_need_an_admin_key(stack, callers):
    body = {"lora_name": TEAM_A_EXTRA, "lora_path": TEAM_A_EXTRA}
    for path in ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]:
        for who, status, code in [("alice", 403, "permission_denied"), ("bob", 403, "permission_denied"),
                                  ("unknown", 401, "invalid_api_key")]:
            response = callers[who].post(path, body)
            assert response.status_code == status, (who, path, response.text)
            assert response.json()["error"]["code"] == code
            openai_schema.validate(response.json(), "ErrorResponse")
    with sdk(stack, ALICE.key) as alice, pytest.raises(openai.PermissionDeniedError):
        alice.post("/load_lora_adapter", body=body, cast_to=str)
    assert TEAM_A_EXTRA not in listed(callers["ops"])

    response = callers["ops"].post("/v1/load_lora_adapter", body)
    assert response.status_code == 200, response.text
    # Loaded: alice's pattern covers it, bob's does not.
    assert TEAM_A_EXTRA in listed(callers["alice"]) and TEAM_A_EXTRA not in listed(callers["bob"])
    response = callers["ops"].post("/v1/unload_lora_adapter", {"lora_name": TEAM_A_EXTRA})
    assert response.status_code == 200, response.text
    assert TEAM_A_EXTRA not in listed(callers["ops"])


def rate_limited(error: openai.RateLimitError) -> int:
    assert error.status_code == 429
    body = error.response.json()
    openai_schema.validate(body, "ErrorResponse")
    assert body["error"]["code"] == "rate_limit_exceeded"
    return int(error.response.headers["retry-after"])


def test_requests_per_minute(stack):
    with sdk(stack, RPM.key) as client:
        for _ in range(2):
            client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=1)
    # Two a minute: one comes back within 30 s.
    assert 1 <= rate_limited(refused.value) <= 30


def test_tokens_per_minute_charge_prompt_and_generated_tokens(stack):
    with sdk(stack, TPM.key) as client:
        first = client.completions.create(model=SERVED_NAME, prompt="hello " * 20, max_tokens=5)
        assert first.usage is not None
        charged = first.usage.prompt_tokens + first.usage.completion_tokens
        assert charged > 10

        def refusal() -> openai.RateLimitError | None:
            # The charge lands when the request's streams are dropped, just after the answer.
            try:
                client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=1)
            except openai.RateLimitError as error:
                return error
            return None

        retry = rate_limited(poll(refusal, "the token charge"))
    # 10 tokens a minute is one per 6 s: the bucket is `charged - 10` in debt and needs one more.
    expected = (charged - 10 + 1) * 6
    assert expected - 6 <= retry <= expected, (retry, charged)


def test_concurrent_requests_hold_their_place_until_the_stream_ends(stack):
    with sdk(stack, SOLO.key) as client:
        stream = client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=1)
        assert rate_limited(refused.value) == 1
        finish = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
        assert finish[-1] == "length"

        def admitted() -> bool:
            try:
                client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=1)
            except openai.RateLimitError:
                return False
            return True

        poll(admitted, "the stream's place to be given back")


def test_metrics_need_an_admin_key(stack, callers):
    """/metrics lists the adapters and key names a tenant must not learn: 401 without a known
    key, 403 for a tenant's key (as loading adapters), 200 for an admin key. The probes stay
    open."""
    status, body = stack.get("/metrics")
    assert status == 401, body
    openai_schema.validate(json.loads(body), "ErrorResponse")
    for who, status, code in [("alice", 403, "permission_denied"), ("bob", 403, "permission_denied"),
                              ("unknown", 401, "invalid_api_key")]:
        response = callers[who].get("/metrics")
        assert response.status_code == status, (who, response.text)
        assert response.json()["error"]["code"] == code
        assert TEAM_B not in response.text and "alice" not in response.text
    scraped = callers["ops"].get("/metrics")
    assert scraped.status_code == 200 and "quiver_requests_running" in scraped.text
    for probe in ["/health", "/info"]:
        assert stack.get(probe)[0] == 200, probe


def key_samples(stack: Stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    ops = Caller(stack.base_url, OPS.key)
    try:
        scraped = ops.get("/metrics")
    finally:
        ops.close()
    assert scraped.status_code == 200, scraped.text
    samples = {}
    for family in text_string_to_metric_families(scraped.text):
        for sample in family.samples:
            if sample.name.startswith("quiver_key_"):
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_count_requests_and_tokens_per_key(stack):
    usages: list[CompletionUsage] = []
    with sdk(stack, METER.key) as client:
        for prompt in ["one", "two words", "three words here"]:
            reply = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=4)
            assert reply.usage is not None
            usages.append(reply.usage)
    # The SDK has no tokenize; a raw call counts as a request too.
    meter = Caller(stack.base_url, METER.key)
    assert meter.post("/tokenize", {"model": SERVED_NAME, "prompt": "hi"}).status_code == 200
    meter.close()
    key = (("key", "meter"),)
    expected = {
        ("quiver_key_requests_total", key): 4.0,
        ("quiver_key_prompt_tokens_total", key): float(sum(u.prompt_tokens for u in usages)),
        ("quiver_key_generated_tokens_total", key): float(sum(u.completion_tokens for u in usages)),
        ("quiver_key_requests_running", key): 0.0,
    }

    def counted() -> bool:
        samples = key_samples(stack)
        return all(samples.get(series) == value for series, value in expected.items())

    poll(counted, f"per-key metrics {expected}")
    samples = key_samples(stack)
    refused = ("quiver_key_requests_refused_total", (("key", "rpm"), ("limit", "requests_per_minute")))
    assert samples[refused] >= 1


def test_sighup_reloads_the_keys_while_a_stream_runs_on(stack, keys_file):
    with sdk(stack, STREAMER.key) as streamer, sdk(stack, NEWCOMER.key) as newcomer:
        stream = streamer.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=200, stream=True,
                                             extra_body={"ignore_eos": True})
        chunks = iter(stream)
        assert next(chunks).choices
        with pytest.raises(openai.AuthenticationError):
            newcomer.models.list()
        # The streamer's own key goes; its running request must not.
        write_keys_file(keys_file, [key for key in KEYS if key is not STREAMER] + [NEWCOMER])
        os.kill(stack.process.pid, signal.SIGHUP)

        def newcomer_in() -> bool:
            try:
                return [m.id for m in newcomer.models.list()] == [SERVED_NAME]
            except openai.AuthenticationError:
                return False

        poll(newcomer_in, "the reloaded keys")
        with pytest.raises(openai.AuthenticationError):
            streamer.models.list()
        rest = [chunk for chunk in chunks if chunk.choices]
        assert rest[-1].choices[0].finish_reason == "length"
        text = "".join(chunk.choices[0].text for chunk in rest)
        assert text

        # A broken file is refused and the keys in use stay.
        keys_file.write_text("keys: [{name: broken}]\n")
        os.kill(stack.process.pid, signal.SIGHUP)
        poll(lambda: "not reloaded" in stack.log(), "the refused reload in the log")
        assert [m.id for m in newcomer.models.list()] == [SERVED_NAME]
    write_keys_file(keys_file, KEYS)
