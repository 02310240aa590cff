"""The Gateway API Inference Extension's own scraping code reads quiver's /metrics correctly under
load: integration-tests/gie is a small Go program on sigs.k8s.io/gateway-api-inference-extension
(pinned in its go.mod) that runs the endpoint picker's model-server metrics client, with the
picker's default (vLLM) metric names, against the stack and prints what it read.

The load is held still by the limits: a batch of two, two long requests on one adapter running,
two on another adapter waiting behind them. What the picker must read then follows from the
configuration alone: 2 running, 2 waiting, the first adapter on the device and the second
waiting, and KV use equal to the blocks the running requests reserved (prompt + max_tokens each,
in blocks of /info's block size) over /info's block count."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from adapter_models import SERVED_NAME, SHARD_ENV, adapter_set
from stack import Stack, StackConfig

REPO = Path(__file__).resolve().parent.parent
GIE_DIR = REPO / "integration-tests" / "gie"
GO_CACHE = REPO / ".cache" / "go"

RUNNING_ADAPTER = "kinds/rank4"
WAITING_ADAPTER = "kinds/rank8"
SLOTS = 2
BATCH = 2
PROMPT = "Hello"
# Long enough that the held requests outlast the scrapes; the stack allows this many.
MAX_TOKENS = 1500
MAX_TOTAL_TOKENS = 1600
DEADLINE_S = 120
# A shared CI box can take minutes to start a stack.
STARTUP_TIMEOUT_S = 300


def go_env() -> dict[str, str]:
    """Go's module and build caches inside the repository's ignored .cache/go (as the Makefile)."""
    env = dict(os.environ)
    env.update(GOPATH=str(GO_CACHE), GOMODCACHE=str(GO_CACHE / "mod"), GOCACHE=str(GO_CACHE / "build"),
               GOFLAGS="-modcacherw")
    return env


@pytest.fixture(scope="module")
def gie_scrape() -> Path:
    """The Go program, built (from the module cache once fetched: `make gie-scrape` fetches it)."""
    go = shutil.which("go")
    assert go, "the Go toolchain is needed to build integration-tests/gie"
    binary = GO_CACHE / "bin" / "gie-scrape"
    subprocess.run([go, "build", "-o", str(binary), "."], cwd=GIE_DIR, env=go_env(), check=True, timeout=900)
    return binary


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    adapters = adapter_set(tmp_path_factory)
    config = StackConfig(
        model_id=str(adapters.base_dir),
        served_model_name=SERVED_NAME,
        max_input_tokens=64,
        max_total_tokens=MAX_TOTAL_TOKENS,
        max_batch_size=BATCH,
        extra_args=["--adapter-source", "local", "--adapter-root", str(adapters.root), "--max-lora-rank", "64",
                    "--max-active-adapters", str(SLOTS),
                    "--preload-adapters", f"{RUNNING_ADAPTER},{WAITING_ADAPTER}",
                    # The waiting pair must wait, not preempt the running one.
                    "--preemption-wait-ms", "600000"],
        extra_env=SHARD_ENV,
    )
    stack = Stack(config, tmp_path_factory.mktemp("logs") / "metrics-gie.log").start(timeout_s=STARTUP_TIMEOUT_S)
    yield stack
    stack.stop()


def scrape(binary: Path, stack: Stack) -> dict[str, Any]:
    host = stack.base_url.removeprefix("http://")
    done = subprocess.run([str(binary), "-host", host], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _json(stack: Stack, path: str, payload: dict | None = None) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(stack.base_url + path, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def test_the_endpoint_picker_reads_queue_running_kv_and_adapters(gie_scrape, stack):
    idle = scrape(gie_scrape, stack)
    limits = _json(stack, "/info")["limits"]
    assert idle["cache_block_size"] == limits["block_size"]
    assert idle["cache_num_blocks"] == limits["num_blocks"]
    # No adapter on the device or waiting yet: the picker skips a LoRA series with both lists
    # empty, so it reads no adapter limit either.
    assert (idle["active_models"], idle["waiting_models"], idle["max_active_models"]) == ([], [], 0)
    assert (idle["running_requests_size"], idle["waiting_queue_size"], idle["kv_cache_usage_percent"]) == (0, 0, 0)

    prompt_tokens = _json(stack, "/tokenize", {"model": SERVED_NAME, "prompt": PROMPT})["count"]
    blocks_each = math.ceil((prompt_tokens + MAX_TOKENS) / limits["block_size"])
    expected_kv = BATCH * blocks_each / limits["num_blocks"]

    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    errors: list[BaseException] = []

    def send(model: str) -> None:
        try:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        except BaseException as error:  # reported by the test thread below
            errors.append(error)

    threads = [threading.Thread(target=send, args=(RUNNING_ADAPTER,)) for _ in range(BATCH)]
    for thread in threads:
        thread.start()
    wait_for(lambda: stack.metrics().get("vllm:num_requests_running") == BATCH, "the first adapter's batch")
    more = [threading.Thread(target=send, args=(WAITING_ADAPTER,)) for _ in range(BATCH)]
    for thread in more:
        thread.start()
    threads += more

    # The picker's reading while two run and two wait (polled: the waiting pair takes a moment to
    # be admitted and queued).
    wanted = {
        "running_requests_size": BATCH,
        "waiting_queue_size": BATCH,
        "active_models": [RUNNING_ADAPTER],
        "waiting_models": [WAITING_ADAPTER],
        "max_active_models": SLOTS,
    }
    deadline = time.monotonic() + DEADLINE_S
    while True:
        read = scrape(gie_scrape, stack)
        if {key: read[key] for key in wanted} == wanted:
            break
        assert time.monotonic() < deadline, f"the picker read {read}, wanted {wanted}"
        # Still setting up: the held batch must not have finished meanwhile.
        assert not errors and read["running_requests_size"] == BATCH, read
        time.sleep(0.05)
    assert read["kv_cache_usage_percent"] == pytest.approx(expected_kv)
    assert 0 < read["kv_cache_usage_percent"] <= 1

    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    # Everything done: the picker sees an idle server with the last adapter still on the device.
    wait_for(lambda: scrape(gie_scrape, stack)["running_requests_size"] == 0, "the load to finish")
    done = scrape(gie_scrape, stack)
    assert done["waiting_queue_size"] == 0 and done["kv_cache_usage_percent"] == 0
    assert done["waiting_models"] == []
    assert set(done["active_models"]) == {RUNNING_ADAPTER, WAITING_ADAPTER}
