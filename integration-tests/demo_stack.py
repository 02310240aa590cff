"""The demo as `make serve` runs it: the launcher with no --model-id, which writes SmolLM2-135M-
Instruct (dequantized from the wheel's GGUF) and its demo adapter into a fresh cache directory and
serves both. Started once per session (conftest's `demo` fixture); the real-model checks and the
README check all talk to it, and read the model and adapter it wrote as their reference's input.

The wheel comes from `make demo-wheel` (.cache/demo-wheel), linked into the cache directory, so
nothing is downloaded at test time: the stack runs with HF_HUB_OFFLINE=1, which keeps the
demo writer from downloading."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import openai

from quiver_server.demo.smollm2_wheel import WHEEL_NAME
from stack import REPO_ROOT, Stack, StackConfig, StackError

DEMO_WHEEL = REPO_ROOT / ".cache" / "demo-wheel" / WHEEL_NAME
# The first start dequantizes 135M parameters (about 20 s on 2 cores) before the shard loads them.
DEMO_STARTUP_TIMEOUT_S = 300
BASE = "quiver-demo"
ADAPTER = "quiver-demo-pirate"
# One OpenMP thread per shard, as every stack of the suite (conftest.SHARD_ENV says why).
SHARD_ENV = {"OMP_NUM_THREADS": "1"}


@dataclass
class Demo:
    stack: Stack
    cache_dir: Path

    @property
    def model_dir(self) -> Path:
        return self.cache_dir / "demo-model"

    @property
    def adapter_dir(self) -> Path:
        return self.model_dir / "adapters" / ADAPTER

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.stack.base_url + "/v1", api_key="unused", max_retries=0,
                             timeout=300)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.stack.base_url + "/v1", api_key="unused", max_retries=0,
                                  timeout=300)


def cache_with_wheel(cache_dir: Path) -> Path:
    """A quiver cache directory holding nothing but the demo's wheel."""
    if not DEMO_WHEEL.is_file():
        raise StackError(f"{DEMO_WHEEL} is missing: `make demo-wheel` fetches it (make test does)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        os.link(DEMO_WHEEL, cache_dir / WHEEL_NAME)
    except OSError:  # another file system
        shutil.copyfile(DEMO_WHEEL, cache_dir / WHEEL_NAME)
    return cache_dir


def start_demo(root: Path) -> Demo:
    cache = cache_with_wheel(root / "cache")
    # As `make serve` runs it: no model, dtype or device.
    config = StackConfig(model_id=None, cache_dir=cache, dtype=None, device=None, cpu_kv_cache_gib=0.25,
                         extra_env=SHARD_ENV)
    stack = Stack(config, root / "demo.log").start(timeout_s=DEMO_STARTUP_TIMEOUT_S)
    return Demo(stack, cache)
