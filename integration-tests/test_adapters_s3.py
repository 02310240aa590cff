"""S3 adapters (`s3://bucket/prefix`) through the real stack: the launcher's --s3-adapter-buckets,
the router's checks, the shard's download from a real S3 API (moto's server on loopback, IAM
authentication on) through a proxy that records, holds or alters what the shard asks for.

* an S3 adapter answers what peft answers with the same files; one with its own tokenizer and
  chat template has its chats rendered as transformers renders them with those files;
* concurrent first requests for one adapter download each file once;
* a missing prefix is 404 `model_not_found`, a file larger than any adapter of --max-lora-rank
  400 `invalid_adapter` (refused from the listing, never downloaded), a bucket outside
  --s3-adapter-buckets 400 `invalid_adapter_id`;
* an adapter whose refusal would quote kilobytes of its config is one bounded 400, and the base
  model and other adapters are served on (issue 48);
* refused credentials are 500 `adapter_load_failed`, and the secret is in neither the answer nor
  the server's log;
* while the store holds a download, a streamed request on the base model runs to its end.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

import openai_schema
import reference
from adapter_models import (
    CHAT,
    MAX_TOKENS,
    SERVED_NAME,
    SHARD_ENV,
    AdapterSet,
    adapter_set,
    chat_ids,
    completion_ids,
    greedy_with,
)
from hostile_adapters import MAX_MESSAGE_BYTES, hostile_copy
from s3_store import AWS_VARIABLES_TO_CLEAR, S3Store, StoreProxy, start_store
from served import RETURN_TOKEN_IDS, prompt_token_ids, stream_token_ids, token_ids
from stack import Stack, StackConfig

BUCKET = "quiver-adapters"
WEIGHTS = "adapter_model.safetensors"
PROMPT = "Hello"
STREAM_TOKENS = 32
CONCURRENT = 4


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> AdapterSet:
    return adapter_set(tmp_path_factory)


@pytest.fixture(scope="module")
def store():
    store = start_store()
    store.create_bucket(BUCKET)
    yield store
    store.stop()


def _start_stack(adapters: AdapterSet, store: S3Store, proxy: StoreProxy, tmp: Path, secret: str | None = None
                 ) -> Stack:
    """The stack, reading BUCKET (and a bucket that does not exist) through `proxy`, with the
    store's key (`secret`: another secret for it)."""
    env = {**SHARD_ENV, **store.server_env(proxy.endpoint, secret=secret, config_dir=tmp / "aws"),
           "QUIVER_ADAPTER_CACHE": str(tmp / "cache")}
    config = StackConfig(
        model_id=str(adapters.base_dir), served_model_name=SERVED_NAME, max_input_tokens=256, max_total_tokens=512,
        extra_args=["--s3-adapter-buckets", f"{BUCKET},no-such-bucket", "--max-lora-rank", "64"], extra_env=env,
    )
    with pytest.MonkeyPatch.context() as patch:
        for name in AWS_VARIABLES_TO_CLEAR:  # the stack inherits the environment: only `env` may count
            patch.delitem(os.environ, name, raising=False)
        return Stack(config, tmp / "stack.log").start()


@pytest.fixture(scope="module")
def served(adapters, store, tmp_path_factory):
    proxy = store.proxy()
    stack = _start_stack(adapters, store, proxy, tmp_path_factory.mktemp("s3-stack"))
    yield stack, proxy
    stack.stop()


@pytest.fixture
def client(served):
    stack, _ = served
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=180) as c:
        yield c


def _upload(store: S3Store, adapters: AdapterSet, kind: str, prefix: str) -> Path:
    directory = adapters.adapter_dir(f"kinds/{kind}")
    store.upload_dir(BUCKET, prefix, directory)
    return directory


def _complete(client, model: str):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body=RETURN_TOKEN_IDS)


def _assert_peft_s(adapters: AdapterSet, response, adapter_dir: Path | None, what: str) -> None:
    want = greedy_with(adapters.base_dir, adapter_dir, completion_ids(adapters, PROMPT), MAX_TOKENS)
    reference.assert_greedy_parity(token_ids(response), want, what)


def _refused(client, model: str, status_error: type[openai.APIStatusError], code: str) -> str:
    with pytest.raises(status_error) as caught:
        _complete(client, model)
    body = caught.value.response.json()
    openai_schema.validate(body, "ErrorResponse")
    assert body["error"]["code"] == code, f"{model!r}: {body}"
    return body["error"]["message"]


def test_an_s3_adapter_answers_as_peft_does(adapters, store, served, client):
    directory = _upload(store, adapters, "rank8", "team/rank8")
    model = f"s3://{BUCKET}/team/rank8"
    response = _complete(client, model)
    assert response.model == model
    _assert_peft_s(adapters, response, directory, model)
    assert model in [listed.id for listed in client.models.list().data]


def test_an_s3_adapter_s_own_tokenizer_and_template_render_its_chats(adapters, store, served, client):
    directory = adapters.adapter_dir("template/own-tokenizer")  # tokenizer files with a template of its own
    store.upload_dir(BUCKET, "team/own-tokenizer", directory)
    model = f"s3://{BUCKET}/team/own-tokenizer"
    response = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body=RETURN_TOKEN_IDS)
    want = chat_ids(adapters, CHAT, tokenizer_dir=directory)
    assert want != chat_ids(adapters, CHAT)  # the test's power: the base's template renders another prompt
    assert prompt_token_ids(response) == want
    reference.assert_greedy_parity(token_ids(response), greedy_with(adapters.base_dir, directory, want, MAX_TOKENS),
                                   model)


def test_concurrent_first_requests_download_once(adapters, store, served, client):
    _, proxy = served
    directory = _upload(store, adapters, "qv-only", "team/qv-only")
    model = f"s3://{BUCKET}/team/qv-only"
    with ThreadPoolExecutor(CONCURRENT) as pool:
        responses = list(pool.map(lambda _: _complete(client, model), range(CONCURRENT)))
    for response in responses:
        _assert_peft_s(adapters, response, directory, model)
    for name in ("adapter_config.json", WEIGHTS):
        assert proxy.gets_of(f"{BUCKET}/team/qv-only/{name}") == 1, proxy.object_gets


def test_a_missing_adapter_is_not_found(served, client):
    for model in (f"s3://{BUCKET}/team/nothing-here", "s3://no-such-bucket/team/a"):
        _refused(client, model, openai.NotFoundError, "model_not_found")


def test_a_file_larger_than_any_adapter_is_refused_unread(adapters, store, served, client):
    _, proxy = served
    store.put(BUCKET, "team/huge/adapter_config.json",
              (adapters.adapter_dir("kinds/rank8") / "adapter_config.json").read_bytes())
    store.put(BUCKET, f"team/huge/{WEIGHTS}", bytes(8 * 2**20))
    message = _refused(client, f"s3://{BUCKET}/team/huge", openai.BadRequestError, "invalid_adapter")
    assert f"{WEIGHTS} is 8.0 MiB, more than any adapter of rank up to 64 for this model can be" in message
    assert not [key for key in proxy.object_gets if key.startswith(f"{BUCKET}/team/huge/")]


def test_a_bucket_the_server_does_not_read_is_refused(served, client):
    _, proxy = served
    before = len(proxy.requests)
    message = _refused(client, "s3://someone-elses-bucket/team/a", openai.BadRequestError, "invalid_adapter_id")
    assert "someone-elses-bucket" in message
    assert len(proxy.requests) == before  # refused before any shard asked the store


def test_an_adapter_naming_200_long_modules_is_one_bounded_400_and_the_server_serves_on(
        adapters, store, served, client, tmp_path):
    hostile = tmp_path / "hostile"
    hostile_copy(adapters.adapter_dir("kinds/rank8"), hostile)
    store.upload_dir(BUCKET, "team/hostile", hostile)
    for _ in range(2):
        message = _refused(client, f"s3://{BUCKET}/team/hostile", openai.BadRequestError, "invalid_adapter")
        assert len(message.encode()) <= MAX_MESSAGE_BYTES, f"{len(message.encode())} bytes: {message[:200]}"
    stack, _ = served
    assert stack.get("/health")[0] == 200
    _assert_peft_s(adapters, _complete(client, SERVED_NAME), None, "the base model after the hostile adapter")
    directory = _upload(store, adapters, "rank8", "team/after-hostile")
    _assert_peft_s(adapters, _complete(client, f"s3://{BUCKET}/team/after-hostile"), directory,
                   "an adapter after the hostile one")


def test_refused_credentials_are_a_server_error_that_never_shows_the_secret(adapters, store, tmp_path):
    _upload(store, adapters, "rank4", "team/guarded")
    wrong_secret = "wrong-secret-0123456789abcdefghijklmnopqrstuv"
    stack = _start_stack(adapters, store, store.proxy(), tmp_path, secret=wrong_secret)
    try:
        with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=180) as client:
            message = _refused(client, f"s3://{BUCKET}/team/guarded", openai.InternalServerError,
                               "adapter_load_failed")
    finally:
        stack.stop()  # its log is then complete
    assert "the object store refused the server's credentials" in message and "SignatureDoesNotMatch" in message
    log = stack.log()
    assert "SignatureDoesNotMatch" in log  # the operator sees the store's answer
    for shown in (message, log):
        assert wrong_secret not in shown and store.secret_access_key not in shown


def test_a_held_download_does_not_stall_a_running_stream(adapters, store, served, client):
    _, proxy = served
    directory = _upload(store, adapters, "rank16", "team/slow")
    model = f"s3://{BUCKET}/team/slow"
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=STREAM_TOKENS, temperature=0,
                                       stream=True, extra_body={**RETURN_TOKEN_IDS, "ignore_eos": True})
    streamed: list[int] = []
    proxy.hold_objects()
    with ThreadPoolExecutor(1) as pool:
        try:
            chunks = iter(stream)
            while not streamed:  # the stream is running
                streamed += [t for choice in next(chunks).choices for t in stream_token_ids(choice)]
            pending = pool.submit(_complete, client, model)
            proxy.wait_held()  # the adapter's download has started, and waits for the store
            for chunk in chunks:
                streamed += [t for choice in chunk.choices for t in stream_token_ids(choice)]
            assert not pending.done()
        finally:
            proxy.release()
        response = pending.result(timeout=180)
    base = greedy_with(adapters.base_dir, None, completion_ids(adapters, PROMPT), STREAM_TOKENS, stop_at_eos=False)
    reference.assert_greedy_parity(streamed, base, "the base's stream while the store held a download")
    assert len(streamed) == STREAM_TOKENS
    _assert_peft_s(adapters, response, directory, model)
