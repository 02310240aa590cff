"""The official openai Node SDK (integration-tests/node, pinned by its package-lock.json): its chat
streaming helper and a streamed completion, with logprobs, run with `node` against the stack. Every
chunk the SDK handed over validates against OpenAI's schema (client_streams); the logprobs hold what OpenAI
documents; the helper's final completion is what the chunks add up to."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from client_streams import join_chat, join_completion
from logprob_checks import check_chat_logprobs, check_completion_logprobs

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "node" / "stream_logprobs.cjs"
# Where `make node-clients` runs `npm ci` (see the Makefile).
NODE_MODULES = HERE.parent / ".cache" / "node-clients" / "node_modules"
NODE_TIMEOUT_S = 300


def _run_node(served: Any) -> dict[str, Any]:
    node = shutil.which("node")
    assert node is not None, "node is not on PATH"
    assert (NODE_MODULES / "openai").is_dir(), (
        f"the Node SDK is not installed in {NODE_MODULES}: run `make node-clients`"
    )
    result = subprocess.run(
        [node, str(SCRIPT), served.stack.base_url + "/v1", served.model],
        env={**os.environ, "NODE_PATH": str(NODE_MODULES)},
        capture_output=True,
        text=True,
        timeout=NODE_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"node exited with {result.returncode}:\n{result.stderr}"
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def node_output(llama) -> dict[str, Any]:
    return _run_node(llama)


def test_chat_stream_helper(node_output):
    joined = join_chat(node_output["chat"]["chunks"])
    assert joined.usage is not None and joined.usage["completion_tokens"] == node_output["maxTokens"]
    assert joined.finish_reasons == ["length"]
    final = node_output["chat"]["final"]["choices"][0]
    assert final["message"]["content"] == joined.text
    assert final["finish_reason"] == "length"


def test_chat_stream_helper_logprobs(node_output, llama):
    joined = join_chat(node_output["chat"]["chunks"])
    assert len(joined.logprobs) == node_output["maxTokens"]
    check_chat_logprobs(joined.logprobs, 2, joined.text, str(llama.model_dir))
    # The helper gathers the chunks' logprobs into its final completion.
    assert node_output["chat"]["final"]["choices"][0]["logprobs"]["content"] == joined.logprobs


def test_completion_stream(node_output):
    joined = join_completion(node_output["completion"]["chunks"])
    assert joined.text and joined.finish_reasons == ["length"]


def test_completion_stream_logprobs(node_output):
    joined = join_completion(node_output["completion"]["chunks"])
    assert len(joined.logprobs["tokens"]) == node_output["maxTokens"]
    check_completion_logprobs(joined.logprobs, 2, joined.text)
