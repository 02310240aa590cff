"""What the structured-output tests share: the schemas of testdata/structured/, their validation
with `jsonschema` (Draft 2020-12, formats checked), and the stack they run against.

The stack serves a tiny random Llama (the adapter tests' base: same builder and seed) with adapters:

    lora              a plain LoRA adapter (the base's tokenizer)
    own-tokenizer     a LoRA adapter whose tokenizer.json maps some JSON punctuation to each
                      other's ids ({ and }, [ and ], " and :): a grammar built for the base's
                      tokenizer would make that adapter's text invalid, so only a grammar built
                      for the adapter's own tokenizer gives output that validates.
    hermes-template   LoRA adapters with only a chat_template.jinja of their own: Hermes 2 Pro's
    llama31-template  and Llama 3.1's tool-use templates from testdata/chat-templates/ (templates
                      that read `tools`, so the tool-call format follows the model family).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from jsonschema import Draft202012Validator

from adapter_models import ADAPTER_KINDS, BASE_SEED, SERVED_NAME, SHARD_ENV, build_adapter
from model_builders import build_model_dir
from stack import Stack, StackConfig

SCHEMA_DIR = Path(__file__).resolve().parent / "testdata" / "structured"
LORA = "lora"
OWN_TOKENIZER = "own-tokenizer"
# The base model and both adapters: every schema runs on each.
MODELS = [SERVED_NAME, LORA, OWN_TOKENIZER]
# Adapter -> the corpus file whose chat template it carries.
TEMPLATE_ADAPTERS = {"hermes-template": "hermes-2-pro-tool-use.json", "llama31-template": "llama-3.1-instruct.json"}
TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "testdata" / "chat-templates"
# Pairs of tokens whose ids the own-tokenizer adapter exchanges.
SWAPPED_TOKENS = [("{", "}"), ("[", "]"), ('"', ":")]
# The stack may start slowly on a busy 2-core box (the shard loads torch and the adapters).
STARTUP_TIMEOUT_S = 240.0
# Enough for every schema's output (the longest takes ~60 tokens on these models); a random
# model only finishes where the grammar bounds the text.
MAX_TOKENS = 400
CHAT = [{"role": "user", "content": "Answer in JSON."}]


def schema_names() -> list[str]:
    return sorted(path.stem for path in SCHEMA_DIR.glob("*.json"))


def load_schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / f"{name}.json").read_text())


def validate(schema: dict[str, Any], text: str) -> Any:
    """The parsed text; AssertionError naming every violation when it does not validate."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise AssertionError(f"not JSON ({err}): {text!r}") from None
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(value)]
    assert not errors, f"{text!r} does not validate: {errors}"
    return value


def json_schema_format(name: str, schema: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


# ---- the stack ----------------------------------------------------------------------------------


def chat_template(adapter: str) -> str:
    """The chat template a TEMPLATE_ADAPTERS adapter carries."""
    return json.loads((TEMPLATE_DIR / TEMPLATE_ADAPTERS[adapter]).read_text())["chat_template"]


def swap_vocabulary(tokenizer_json: Path, pairs: list[tuple[str, str]]) -> None:
    """Exchanges the ids of each pair of byte-level tokens in a tokenizer.json. Merges name
    tokens by their text, so the tokenizer stays consistent: it only numbers them otherwise."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    for a, b in pairs:
        vocab[a], vocab[b] = vocab[b], vocab[a]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))


@dataclass(frozen=True)
class StructuredSet:
    base_dir: Path
    root: Path


_SETS: dict[str, StructuredSet] = {}


def structured_set(tmp_path_factory) -> StructuredSet:
    """This tier's base model (the adapter tests' tiny Llama) and adapter root, built once."""
    if "set" not in _SETS:
        tmp = tmp_path_factory.mktemp("structured-models")
        base_dir = build_model_dir("llama", tmp / "base", seed=BASE_SEED)
        root = tmp / "adapters"
        build_adapter(base_dir, root / LORA, seed=500, **ADAPTER_KINDS["rank8"])
        own = build_adapter(base_dir, root / OWN_TOKENIZER, seed=501, **ADAPTER_KINDS["qv-only"])
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (base_dir / name).exists():
                (own / name).write_bytes((base_dir / name).read_bytes())
        swap_vocabulary(own / "tokenizer.json", SWAPPED_TOKENS)
        for seed, adapter in enumerate(TEMPLATE_ADAPTERS, start=502):
            templated = build_adapter(base_dir, root / adapter, seed=seed, **ADAPTER_KINDS["rank4"])
            (templated / "chat_template.jinja").write_text(chat_template(adapter))
        _SETS["set"] = StructuredSet(base_dir=base_dir, root=root)
    return _SETS["set"]


def start_structured_stack(tmp_path_factory, name: str, extra_args: list[str] | None = None) -> Stack:
    models = structured_set(tmp_path_factory)
    config = StackConfig(
        model_id=str(models.base_dir),
        served_model_name=SERVED_NAME,
        # Tool-use templates render long prompts (~1400 tokens with this small vocabulary); the
        # model's positions end at 2048.
        max_input_tokens=1536,
        max_total_tokens=2048,
        extra_args=["--adapter-source", "local", "--adapter-root", str(models.root), "--max-lora-rank", "64",
                    *(extra_args or [])],
        extra_env=SHARD_ENV,
    )
    log_dir = tmp_path_factory.mktemp("logs")
    return Stack(config, log_dir / f"{name}.log").start(timeout_s=STARTUP_TIMEOUT_S)


def post(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, response = stack.post_json(path, body, timeout=300)
    assert status == 200, f"{path} {json.dumps(body)[:400]}: {status} {response}"
    return response


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def stream_chat(stack: Stack, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a chat completion streamed through the official SDK, as dicts (fields
    outside the SDK's types included)."""
    known = {"model", "messages", "max_tokens", "temperature", "seed", "n", "response_format", "tools",
             "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs", "logit_bias"}
    options = {key: value for key, value in body.items() if key in known}
    extra = {key: value for key, value in body.items() if key not in known}
    with client(stack) as sdk:
        stream = sdk.chat.completions.create(**options, stream=True, extra_body=extra or None)
        return [chunk.to_dict() for chunk in stream]
