"""Adapter files nested 100,000 levels deep (issue 48, finding 7) are a 400 `invalid_adapter`, and
the server goes on serving the base and a good adapter.

* `adapter_config.json`, which the shard reads: Python's decoder recursed past the interpreter's
  limit, and the RecursionError was a 500;
* `tokenizer_config.json`, which the router reads for the adapter's own chat template: serde_json
  stops at 128 levels, so this one was already refused; kept here so that it stays so.
"""

from __future__ import annotations

import shutil

import openai
import pytest

import openai_schema
import reference
from adapter_models import MAX_TOKENS, SERVED_NAME, adapter_set, completion_ids, peft_greedy, start_adapter_stack
from served import RETURN_TOKEN_IDS, token_ids

GOOD = "kinds/rank8"  # copied into this module's own adapter root under the same id
DEPTH = 100_000
# The router's message around the shard's: a few hundred bytes either way (docs/security.md).
MAX_MESSAGE_CHARS = 1024


def _nested(key: str) -> str:
    return '{"' + key + '": ' + "[" * DEPTH + "]" * DEPTH + "}"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return adapter_set(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-root")
    shutil.copytree(adapters.adapter_dir(GOOD), root / GOOD)
    config = shutil.copytree(adapters.adapter_dir(GOOD), root / "nested-config")
    (config / "adapter_config.json").write_text(_nested("target_modules"))
    tokenizer = shutil.copytree(adapters.adapter_dir(GOOD), root / "nested-tokenizer-config")
    (tokenizer / "tokenizer_config.json").write_text(_nested("chat_template"))
    stack = start_adapter_stack(adapters.base_dir, root, tmp_path_factory.mktemp("logs"), "hostile-adapter-files")
    yield stack
    stack.stop()


def _complete(client: openai.OpenAI, model: str):
    return client.completions.create(model=model, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body=RETURN_TOKEN_IDS)


@pytest.mark.parametrize("model", ["nested-config", "nested-tokenizer-config"])
def test_a_deeply_nested_adapter_file_is_a_400_and_the_server_goes_on(adapters, stack, model):
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            _complete(client, model)
        body = caught.value.response.json()
        openai_schema.validate(body, "ErrorResponse")
        assert body["error"]["code"] == "invalid_adapter", body
        assert len(body["error"]["message"]) <= MAX_MESSAGE_CHARS, body
        assert model not in [m.id for m in client.models.list().data]
        assert stack.get("/health")[0] == 200
        ids = completion_ids(adapters, "Hello")
        for served, adapter_id in ((SERVED_NAME, None), (GOOD, GOOD)):
            reference.assert_greedy_parity(token_ids(_complete(client, served)), peft_greedy(adapters, adapter_id, ids),
                                           f"{served} after {model}")
