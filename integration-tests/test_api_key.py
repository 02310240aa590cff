"""`--api-key`: requests without the right bearer token get 401 in OpenAI's shape; /metrics too
(the one key is an admin key); the probes stay open."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

import openai_schema
from conftest import SHARD_ENV
from stack import Stack, StackConfig

KEY = "sk-test-quiver"


def test_api_key_is_required_when_set(pool, tmp_path):
    config = StackConfig(model_id=str(pool.model_dir("llama")), served_model_name="tiny",
                         extra_args=["--api-key", KEY], extra_env=SHARD_ENV)
    with Stack(config, tmp_path / "api-key.log") as stack:
        assert KEY not in stack.log(), "the key must not be logged"
        for key in ("wrong", ""):
            with openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key or "unused",
                               max_retries=0) as client:
                headers = {"Authorization": ""} if not key else None
                with pytest.raises(openai.AuthenticationError) as caught:
                    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2, extra_headers=headers)
                assert caught.value.status_code == 401
                openai_schema.validate(caught.value.response.json(), "ErrorResponse")
        with openai.OpenAI(base_url=stack.base_url + "/v1", api_key=KEY, max_retries=0) as client:
            reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2)
            assert reply.choices[0].finish_reason in ("stop", "length")
        status, body = stack.get("/metrics")
        assert status == 401, body
        openai_schema.validate(json.loads(body), "ErrorResponse")
        scraped = httpx.get(stack.base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert scraped.status_code == 200 and "quiver_requests_running" in scraped.text
        assert stack.get("/health")[0] == 200 and stack.get("/info")[0] == 200
