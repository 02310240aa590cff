"""`make serve`'s path: the launcher without --model-id creates the demo model in its cache
directory and serves it, and the README's OpenAI SDK example runs against it as written (only
the port differs, so the test never collides with a server on 8080)."""

from __future__ import annotations

import re
import subprocess

from stack import REPO_ROOT, VENV_BIN, Stack, StackConfig

DEMO_STARTUP_TIMEOUT_S = 180  # the first start writes the model and trains its tokenizer


def _readme_sdk_examples() -> list[str]:
    readme = REPO_ROOT / "README.md"
    assert readme.exists(), "README.md is missing"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    examples = [b for b in blocks if "OpenAI(" in b and "chat.completions.create" in b]
    assert examples, "README.md has no ```python block with an OpenAI SDK chat completion"
    return examples


def test_demo_model_is_created_and_serves_the_readme_example(tmp_path):
    examples = _readme_sdk_examples()
    cache = tmp_path / "cache"
    # As `make serve` runs it: no model, dtype or device; only a small KV cache to spare memory.
    config = StackConfig(model_id=None, cache_dir=cache, dtype=None, device=None)
    stack = Stack(config, tmp_path / "demo.log")
    stack.start(timeout_s=DEMO_STARTUP_TIMEOUT_S)
    try:
        assert list(cache.rglob("config.json")), f"no demo model written under {cache}"
        for example in examples:
            assert ":8080" in example, f"the README example does not use the default port:\n{example}"
            code = example.replace(":8080", f":{stack.port}")
            run = subprocess.run([str(VENV_BIN / "python"), "-c", code], capture_output=True,
                                 text=True, timeout=300)
            assert run.returncode == 0, (
                f"README example failed:\n{code}\n--- stderr ---\n{run.stderr}\n"
                f"--- launcher log ---\n{stack.log()[-4000:]}"
            )
    finally:
        stack.stop()
