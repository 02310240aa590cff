"""Adapters the server must refuse, with OpenAI-shaped errors, and keep serving afterwards:

* local ids that escape --adapter-root (an absolute path, a `..` component, a symlink inside the
  root that points outside it) are 400 `invalid_adapter_id`; an unknown id is 404
  `model_not_found`; a symlink that stays inside the root is served;
* an adapter that does not fit the base model (made for a narrower model, or of a rank over
  --max-lora-rank) is 400 `invalid_adapter` whose message says what differs, and is not
  remembered as loaded;
* an adapter whose refusal would quote kilobytes of its own config (200 long target module
  names) is one bounded 400: the shard's message once broke the router's connection to it and
  every later request got 503 (issue 48).

No message may show a server path (docs/adapters.md)."""

from __future__ import annotations

import openai
import pytest

import openai_schema
import reference
from adapter_models import MAX_TOKENS, SERVED_NAME, adapter_set, completion_ids, peft_greedy, start_stack
from hostile_adapters import MAX_MESSAGE_BYTES, hostile_copy
from served import RETURN_TOKEN_IDS, token_ids


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return adapter_set(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), "adapters-refusals")
    yield stack
    stack.stop()


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _complete(client, model: str, **extra):
    return client.completions.create(model=model, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={**RETURN_TOKEN_IDS, **extra})


def _refused(adapters, client, model: str, status_error: type[openai.APIStatusError], code: str, **extra) -> str:
    """Sends a completion for `model`, checks the error's status, code and shape; its message."""
    with pytest.raises(status_error) as caught:
        _complete(client, model, **extra)
    body = caught.value.response.json()
    openai_schema.validate(body, "ErrorResponse")
    error = body["error"]
    assert error["code"] == code, f"{model!r}: {body}"
    assert error["type"] == "invalid_request_error", f"{model!r}: {body}"
    return error["message"]


def _server_paths_shown(adapters, message: str, sent: str) -> bool:
    """Whether `message` shows a path of the server's beyond what the client sent itself."""
    tmp = str(adapters.root.parent)  # base, root and the outside directory all live below it
    return tmp in message.replace(sent, "")


def _assert_still_serving(adapters, client, stack) -> None:
    assert stack.get("/health")[0] == 200
    ids = completion_ids(adapters, "Hello")
    for model, adapter_id in ((SERVED_NAME, None), ("kinds/rank8", "kinds/rank8")):
        want = peft_greedy(adapters, adapter_id, ids)
        reference.assert_greedy_parity(token_ids(_complete(client, model)), want, f"after refusals: {model}")


def _listed(client) -> list[str]:
    return [model.id for model in client.models.list().data]


# ---- escapes from --adapter-root ------------------------------------------------------------------


def test_absolute_paths_are_refused(adapters, client, stack):
    # Even one that lies inside the root: local ids are relative to it.
    for model in (str(adapters.root / "kinds" / "rank8"), str(adapters.outside), "/etc"):
        _refused(adapters, client, model, openai.BadRequestError, "invalid_adapter_id")
        # Naming the source explicitly changes nothing.
        _refused(adapters, client, model, openai.BadRequestError, "invalid_adapter_id", adapter_source="local")
    _assert_still_serving(adapters, client, stack)


def test_parent_components_are_refused(adapters, client, stack):
    # `../outside/evil` is a valid adapter, reachable only by climbing out of the root; a `..`
    # that would stay inside the root is refused all the same.
    for model in ("../outside/evil", "../x", "kinds/../kinds/rank8", "kinds/rank8/.."):
        _refused(adapters, client, model, openai.BadRequestError, "invalid_adapter_id")
    _assert_still_serving(adapters, client, stack)


def test_symlink_leaving_the_root_is_refused(adapters, client, stack):
    assert (adapters.root / "escape").resolve() == adapters.outside.resolve()
    message = _refused(adapters, client, "escape", openai.BadRequestError, "invalid_adapter_id")
    assert not _server_paths_shown(adapters, message, "escape"), f"it tells where the link points: {message}"
    assert "escape" not in _listed(client)
    _assert_still_serving(adapters, client, stack)


def test_symlink_inside_the_root_is_served(adapters, client):
    """`alias` -> kinds/rank8 stays inside the root: served as that adapter."""
    response = _complete(client, "alias")
    ids = completion_ids(adapters, "Hello")
    reference.assert_greedy_parity(token_ids(response), peft_greedy(adapters, "kinds/rank8", ids), "alias")
    assert response.model == "alias"


def test_unknown_local_adapter_is_404(adapters, client, stack):
    for model in ("kinds/no-such-kind", "no-such-adapter"):
        _refused(adapters, client, model, openai.NotFoundError, "model_not_found")
        assert model not in _listed(client)
    _assert_still_serving(adapters, client, stack)


def test_escape_through_load_endpoint_is_refused(adapters, stack):
    """/v1/load_lora_adapter applies the same checks to `lora_path`."""
    for path in (str(adapters.outside), "../outside/evil", "escape"):
        status, body = stack.post_json("/v1/load_lora_adapter",
                                       {"lora_name": "evil", "lora_path": path, "adapter_source": "local"})
        assert status == 400, f"{path}: {status} {body}"
        openai_schema.validate(body, "ErrorResponse")
        assert body["error"]["code"] == "invalid_adapter_id", f"{path}: {body}"
        assert not _server_paths_shown(adapters, body["error"]["message"], path), body
    status, _ = stack.get("/v1/models/evil")
    assert status == 404


# ---- adapters that do not fit the base ----------------------------------------------------------


def _refused_twice(adapters, client, model: str) -> str:
    """A failed load is not cached as loaded: asking again gets the same answer."""
    first = _refused(adapters, client, model, openai.BadRequestError, "invalid_adapter")
    second = _refused(adapters, client, model, openai.BadRequestError, "invalid_adapter")
    assert first == second, (first, second)
    assert model not in _listed(client)
    return first


def test_adapter_for_a_narrower_model_is_refused_saying_what_differs(adapters, client, stack):
    # adapter_config.json names the base it was made for, inside the adapter root: the config
    # comparison and the shapes.
    message = _refused_twice(adapters, client, "bad/hidden-32")
    assert "hidden_size=32, this model has 64" in message, message
    _assert_still_serving(adapters, client, stack)


def test_adapter_shapes_alone_show_the_mismatch(adapters, client, stack):
    # No pointer to its base: the weights' shapes against the base's projections tell.
    message = _refused_twice(adapters, client, "bad/hidden-32-no-hint")
    assert "q_proj" in message and "32" in message and "64" in message, message
    _assert_still_serving(adapters, client, stack)


def test_rank_over_max_lora_rank_is_refused(adapters, client, stack):
    message = _refused_twice(adapters, client, "bad/rank128")
    assert "128" in message and "64" in message, message
    _assert_still_serving(adapters, client, stack)


def test_broken_adapter_directories_are_refused(adapters, client, stack):
    """A directory without weights, or without adapter_config.json, is 400 `invalid_adapter`."""
    assert "safetensors" in _refused_twice(adapters, client, "bad/no-weights")
    assert "adapter_config.json" in _refused_twice(adapters, client, "bad/empty")
    _assert_still_serving(adapters, client, stack)


def test_refusal_messages_show_no_server_path(adapters, client):
    """docs/adapters.md: "Error messages never show server paths" — the client may see its own
    id echoed, nothing of the server's directories (adapter root, base models)."""
    cases = [
        ("../outside/evil", openai.BadRequestError, "invalid_adapter_id"),
        ("escape", openai.BadRequestError, "invalid_adapter_id"),
        ("kinds/no-such-kind", openai.NotFoundError, "model_not_found"),
        ("bad/hidden-32", openai.BadRequestError, "invalid_adapter"),
        ("bad/hidden-32-no-hint", openai.BadRequestError, "invalid_adapter"),
        ("bad/rank128", openai.BadRequestError, "invalid_adapter"),
        ("bad/no-weights", openai.BadRequestError, "invalid_adapter"),
        ("bad/empty", openai.BadRequestError, "invalid_adapter"),
    ]
    leaks = {}
    for model, error, code in cases:
        message = _refused(adapters, client, model, error, code)
        if _server_paths_shown(adapters, message, model):
            leaks[model] = message
    assert not leaks, f"error messages show server paths: {leaks}"


# ---- adapters whose files would flood the error path ---------------------------------------------


def test_an_adapter_naming_200_long_modules_is_one_bounded_400_and_the_server_serves_on(adapters, client, stack):
    hostile_copy(adapters.adapter_dir("kinds/rank8"), adapters.root / "hostile" / "modules")
    for _ in range(2):
        message = _refused(adapters, client, "hostile/modules", openai.BadRequestError, "invalid_adapter")
        assert len(message.encode()) <= MAX_MESSAGE_BYTES, f"{len(message.encode())} bytes: {message[:200]}"
    # The base model and another adapter answer as transformers and peft do, and /health is 200.
    _assert_still_serving(adapters, client, stack)
