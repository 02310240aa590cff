"""Fixtures: tiny models on disk, one running stack per model for the whole session, and
OpenAI SDK clients pointed at it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stack import STARTED, Stack, StackConfig  # noqa: E402
from model_builders import build_model_dir, build_parrot_model  # noqa: E402
from demo_stack import Demo, start_demo  # noqa: E402
from thinking_models import ThinkingStack, start_qwen3_parrot, start_r1_parrot  # noqa: E402

ARCHS = ["llama", "mistral", "qwen2"]
# Distinct weights per architecture (llama and mistral share a layout).
_SEEDS = {"llama": 1, "mistral": 2, "qwen2": 3}
# Scales the LM head's EOS row so that the test prompts end some greedy continuations with EOS
# and run others to max_tokens (see model_builders; tuned once for these seeds).
EOS_BOOST = 2.5

# torch's OpenMP workers busy-wait on every core; on a 2-core CI box they starve the router and
# the test client, and a /metrics scrape can then miss a whole batch. One thread per shard.
SHARD_ENV = {"OMP_NUM_THREADS": "1"}

# Limits the bad-input tests run against; every stack of the pool serves with them.
MAX_INPUT_TOKENS = 256
MAX_TOTAL_TOKENS = 1024


@dataclass
class Served:
    """A running stack and what a test needs to talk to it."""

    arch: str
    model_dir: Path
    stack: Stack
    model: str  # the served model name

    def client(self) -> openai.OpenAI:
        # No retries: a 429/5xx must surface as the error it is, not be retried away.
        return openai.OpenAI(base_url=self.stack.base_url + "/v1", api_key="unused",
                             max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.stack.base_url + "/v1", api_key="unused",
                                  max_retries=0, timeout=120)


class StackPool:
    """Starts at most one stack per architecture per session, on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._served: dict[str, Served] = {}
        # A stack that failed to start fails every later test fast, with the same log.
        self._failed: dict[str, BaseException] = {}

    def model_dir(self, name: str) -> Path:
        """`name` is an architecture of ARCHS, or "parrot" (see model_builders)."""
        path = self.root / "models" / name
        if not (path / "config.json").exists():
            if name == "parrot":
                build_parrot_model(path)
            else:
                build_model_dir(name, path, seed=_SEEDS[name], eos_boost=EOS_BOOST)
        return path

    def get(self, arch: str) -> Served:
        if arch in self._failed:
            raise self._failed[arch]
        if arch not in self._served:
            model_dir = self.model_dir(arch)
            config = StackConfig(
                model_id=str(model_dir),
                served_model_name=f"tiny-{arch}",
                max_input_tokens=MAX_INPUT_TOKENS,
                max_total_tokens=MAX_TOTAL_TOKENS,
                extra_env=SHARD_ENV,
            )
            try:
                stack = Stack(config, self.root / "logs" / f"{arch}.log").start()
            except BaseException as err:
                self._failed[arch] = err
                raise
            self._served[arch] = Served(arch, model_dir, stack, f"tiny-{arch}")
        return self._served[arch]

    def close(self) -> None:
        for served in self._served.values():
            served.stack.stop()


@pytest.fixture(scope="session", autouse=True)
def no_stack_outlives_the_session() -> Iterator[None]:
    """Set up first, so torn down last: every launcher a test or fixture started has exited by
    then. One still running is a leak of the suite (it keeps a port, a shard and its memory);
    it is killed and the session fails, naming its log."""
    yield
    left = [stack for stack in STARTED if stack.proc is not None and stack.proc.poll() is None]
    for stack in left:
        stack.kill()
    assert not left, f"stacks left running after the tests: {[str(s.log_path) for s in left]}"


@pytest.fixture(scope="session")
def pool(tmp_path_factory) -> Iterator[StackPool]:
    pool = StackPool(tmp_path_factory.mktemp("quiver"))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> Iterator[Demo]:
    """The real demo (SmolLM2-135M-Instruct and its pirate adapter), written and served by the
    launcher as `make serve` does it, once per session."""
    served = start_demo(tmp_path_factory.mktemp("demo"))
    yield served
    served.stack.stop()


@pytest.fixture(scope="session")
def qwen3_parrot(tmp_path_factory) -> Iterator[ThinkingStack]:
    """A thinking parrot with Qwen3's template, and an adapter without a thinking template
    (thinking_models), served once per session."""
    served = start_qwen3_parrot(tmp_path_factory.mktemp("qwen3-parrot"))
    yield served
    served.stack.stop()


@pytest.fixture(scope="session")
def r1_parrot(tmp_path_factory) -> Iterator[ThinkingStack]:
    """A thinking parrot with DeepSeek-R1's template (thinking_models), served once per session."""
    served = start_r1_parrot(tmp_path_factory.mktemp("r1-parrot"))
    yield served
    served.stack.stop()


@pytest.fixture(scope="session")
def llama(pool) -> Served:
    """The stack most behaviour tests run against."""
    return pool.get("llama")


@pytest.fixture
def client(llama) -> Iterator[openai.OpenAI]:
    with llama.client() as c:
        yield c
