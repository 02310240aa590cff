"""The model list and the adapter endpoints: `GET /v1/models` lists the base model first, then the
preloaded and loaded adapters with the base as `parent`; `GET /v1/models/{id}`; 404
`model_not_found` for unknown ids; `POST /v1/load_lora_adapter` / `unload_lora_adapter` (vLLM's
names and fields) load and unload at run time, and an unload lets running requests finish.
Bodies are checked against OpenAI's published schemas; outputs against peft."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

import openai_schema
import reference
from adapter_models import MAX_TOKENS, SERVED_NAME, adapter_set, completion_ids, peft_greedy, start_stack
from reliability_checks import sse_payloads
from served import RETURN_TOKEN_IDS, raw_json, token_ids
from stack import parse_prometheus

PRELOADED = "kinds/rank4"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return adapter_set(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), "adapters-models",
                        extra_args=["--preload-adapters", PRELOADED])
    yield stack
    stack.stop()


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _listing(client) -> list[dict]:
    body = raw_json(client.models.with_raw_response.list())
    openai_schema.validate(body, "ListModelsResponse")
    assert body["object"] == "list"
    return body["data"]


def _card(stack, model_id: str) -> tuple[int, dict]:
    status, body = stack.get(f"/v1/models/{model_id}")
    return status, json.loads(body)


def _assert_adapter_card(card: dict, model_id: str) -> None:
    openai_schema.validate(card, "Model")
    assert card["id"] == model_id and card["object"] == "model", card
    assert card["parent"] == SERVED_NAME, card
    assert isinstance(card["created"], int) and card["owned_by"], card


def _assert_matches_peft(adapters, client, model: str, adapter_id: str) -> None:
    """A completion through `model` equals peft's greedy output for the adapter `adapter_id`."""
    response = client.completions.create(model=model, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body=RETURN_TOKEN_IDS)
    ids = completion_ids(adapters, "Hello")
    reference.assert_greedy_parity(token_ids(response), peft_greedy(adapters, adapter_id, ids), model)
    assert response.model == model


def _load(stack, payload: dict) -> tuple[int, str]:
    status, body = stack.post_raw("/v1/load_lora_adapter", json.dumps(payload).encode())
    return status, body.decode()


def _unload(stack, name: str) -> tuple[int, str]:
    status, body = stack.post_raw("/v1/unload_lora_adapter", json.dumps({"lora_name": name}).encode())
    return status, body.decode()


def _error(status_and_body: tuple[int, str], status: int, code: str) -> dict:
    got_status, body = status_and_body
    assert got_status == status, status_and_body
    error = json.loads(body)
    openai_schema.validate(error, "ErrorResponse")
    assert error["error"]["code"] == code, error
    return error["error"]


def test_base_first_then_preloaded_and_loaded_adapters(adapters, client, stack):
    data = _listing(client)
    base = data[0]
    openai_schema.validate(base, "Model")
    assert base["id"] == SERVED_NAME and base.get("parent") is None, base
    assert PRELOADED in [card["id"] for card in data[1:]]

    # A request loads an adapter on demand; it is listed after that.
    _assert_matches_peft(adapters, client, "kinds/qv-only", "kinds/qv-only")
    data = _listing(client)
    assert data[0]["id"] == SERVED_NAME
    for model_id in (PRELOADED, "kinds/qv-only"):
        (card,) = [card for card in data if card["id"] == model_id]
        _assert_adapter_card(card, model_id)
    # The preloaded adapter serves its own weights.
    _assert_matches_peft(adapters, client, PRELOADED, PRELOADED)


def test_retrieve_models_and_adapters(adapters, client, stack):
    base = raw_json(client.models.with_raw_response.retrieve(SERVED_NAME))
    openai_schema.validate(base, "Model")
    assert base["id"] == SERVED_NAME
    # Adapter ids hold slashes: the route takes the rest of the path.
    status, card = _card(stack, PRELOADED)
    assert status == 200, card
    _assert_adapter_card(card, PRELOADED)


def test_unknown_ids_are_404(adapters, client, stack):
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    body = caught.value.response.json()
    openai_schema.validate(body, "ErrorResponse")
    assert body["error"]["code"] == "model_not_found"
    # An adapter that exists on disk but was never asked for is not loaded: looking it up does
    # not load it.
    status, body = _card(stack, "kinds/rank64")
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    assert "kinds/rank64" not in [card["id"] for card in _listing(client)]


def test_load_serve_and_unload_under_a_chosen_name(adapters, client, stack):
    assert _load(stack, {"lora_name": "sql", "lora_path": "kinds/rank16", "adapter_source": "local"}) == (
        200, "Success: LoRA adapter 'sql' added successfully.")
    status, card = _card(stack, "sql")
    assert status == 200, card
    _assert_adapter_card(card, "sql")
    assert "sql" in [c["id"] for c in _listing(client)]
    _assert_matches_peft(adapters, client, "sql", "kinds/rank16")

    # Loading the same name from the same place again is a no-op; from elsewhere, refused.
    assert _load(stack, {"lora_name": "sql", "lora_path": "kinds/rank16", "adapter_source": "local"})[0] == 200
    _error(_load(stack, {"lora_name": "sql", "lora_path": "kinds/rank8", "adapter_source": "local"}),
           400, "adapter_already_loaded")
    _assert_matches_peft(adapters, client, "sql", "kinds/rank16")

    assert _unload(stack, "sql") == (200, "Success: LoRA adapter 'sql' removed successfully.")
    status, body = _card(stack, "sql")
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    assert "sql" not in [c["id"] for c in _listing(client)]
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="sql", prompt="Hello", max_tokens=MAX_TOKENS)
    assert caught.value.response.json()["error"]["code"] == "model_not_found"
    _error(_unload(stack, "sql"), 404, "model_not_found")

    # Once gone, the name can be loaded again, here from another adapter. The unload answered
    # before the shards forgot the adapter; until then a load under its name is refused as an
    # unknown (unloading) model, and nothing else. Each refusal is a round trip to the router,
    # which paces the retries; the deadline only guards against a hang.
    deadline = time.monotonic() + 30
    while (result := _load(stack, {"lora_name": "sql", "lora_path": "kinds/mlp-only",
                                   "adapter_source": "local"}))[0] != 200:
        _error(result, 404, "model_not_found")
        assert time.monotonic() < deadline, f"the name is still refused 30s after the unload: {result}"
    _assert_matches_peft(adapters, client, "sql", "kinds/mlp-only")
    # The rest kept working throughout.
    _assert_matches_peft(adapters, client, PRELOADED, PRELOADED)


def test_load_takes_vllm_style_absolute_paths_inside_the_root(adapters, client, stack):
    path = str(adapters.root / "kinds" / "every-linear")
    assert _load(stack, {"lora_name": "everything", "lora_path": path})[0] == 200
    _assert_matches_peft(adapters, client, "everything", "kinds/every-linear")
    assert _unload(stack, "everything")[0] == 200


def test_load_endpoint_refusals(adapters, stack):
    _error(_load(stack, {"lora_name": SERVED_NAME, "lora_path": "kinds/rank8", "adapter_source": "local"}),
           400, "invalid_value")
    _error(_load(stack, {"lora_path": "kinds/rank8"}), 400, "missing_required_parameter")
    _error(_load(stack, {"lora_name": "x", "lora_path": "kinds/none", "adapter_source": "local"}),
           404, "model_not_found")
    _error(_load(stack, {"lora_name": "x", "lora_path": "bad/rank128", "adapter_source": "local"}),
           400, "invalid_adapter")
    _error(_unload(stack, "never-loaded"), 404, "model_not_found")


def _streamed_ids_and_reason(body: bytes) -> tuple[list[int], str | None]:
    """Token ids and finish reason of a raw completions SSE body (vLLM's `token_ids` per chunk)."""
    ids: list[int] = []
    reason: str | None = None
    for payload in sse_payloads(body):
        if payload == "[DONE]":
            continue
        chunk = json.loads(payload)
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            ids += choice.get("token_ids") or []
            reason = choice.get("finish_reason") or reason
    return ids, reason


def test_unload_lets_running_requests_finish(adapters, stack):
    """Streams for an adapter that is unloaded meanwhile run to their end with the adapter's
    tokens; new requests for it are refused at once."""
    max_tokens, streams = 480, 8
    ids = completion_ids(adapters, "Hello")
    want = peft_greedy(adapters, "kinds/rank8", ids, max_tokens, stop_at_eos=False)

    async def one_stream(http: httpx.AsyncClient, name: str, leader: bool) -> tuple[bytes, bool | None]:
        """The raw SSE body of one stream. The leader unloads the adapter once its first bytes
        came and says whether a request was still running once the unload had answered. Bodies
        are only collected here, parsed afterwards: the server outruns a client that parses each
        chunk as it comes, and the unload must follow the first chunk closely."""
        request = {"model": name, "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0,
                   "stream": True, "ignore_eos": True, **RETURN_TOKEN_IDS}
        body = bytearray()
        still_running: bool | None = None
        async with http.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200, await response.aread()
            async for part in response.aiter_bytes():
                body += part
                if leader and still_running is None and b"data:" in body:
                    unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": name})
                    assert unloaded.status_code == 200, unloaded.text
                    metrics = parse_prometheus((await http.get("/metrics")).text)
                    still_running = metrics["quiver_requests_running"] >= 1
                    refused = await http.post("/v1/completions",
                                              json={"model": name, "prompt": "Hi", "max_tokens": 2})
                    _error((refused.status_code, refused.text), 404, "model_not_found")
        return bytes(body), still_running

    async def attempt(name: str) -> bool:
        """Several streams share the batch (so it lasts), the first one unloads the adapter; whether
        a request was still running when the unload had answered (the test's premise)."""
        assert _load(stack, {"lora_name": name, "lora_path": "kinds/rank8", "adapter_source": "local"})[0] == 200
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
            results = await asyncio.gather(*(one_stream(http, name, i == 0) for i in range(streams)))
        for body, _ in results:
            got, reason = _streamed_ids_and_reason(body)
            assert reason == "length", name
            reference.assert_greedy_parity(got, want, name)
        return bool(results[0][1])

    async def main() -> bool:
        # Timing decides whether the streams still run when the unload answers; eight streams of
        # 480 tokens, a client that only collects bytes meanwhile, and a few tries make that (all
        # but) certain without a sleep in the server.
        for i in range(5):
            if await attempt(f"leaving-{i}"):
                return True
        return False

    assert asyncio.run(asyncio.wait_for(main(), 300)), "every stream ended before its unload: nothing proven"
