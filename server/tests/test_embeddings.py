"""Embeddings from the engine against transformers' hidden states pooled by sentence-transformers'
own Pooling and Normalize modules: the default (last token, L2-normalized) and every pooling a
sentence-transformers config can ask for, on the base model and under a LoRA adapter (peft's
hidden states), in one Prefill beside generating requests whose tokens stay peft's. A pipeline
with a module the shard does not apply is refused with its name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from block_tables import Blocks
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling
from tiny_adapters import build_adapter, peft_reference, reference_greedy
from tiny_models import build_tiny_model

from quiver_server.engine.batch_types import RequestSpec
from quiver_server.engine.engine import Engine
from quiver_server.engine.pooling import DEFAULT, read_pooling

PROMPTS = [[5, 17, 42, 9, 120, 33, 7], [250, 3], list(range(40, 75))]
ADAPTER = "all-linear"
# Our mode -> sentence-transformers' `pooling_mode` name and the flag older releases wrote.
ST_MODES = {
    "cls": ("cls", "pooling_mode_cls_token"),
    "mean": ("mean", "pooling_mode_mean_tokens"),
    "max": ("max", "pooling_mode_max_tokens"),
    "mean_sqrt_len": ("mean_sqrt_len_tokens", "pooling_mode_mean_sqrt_len_tokens"),
    "weighted_mean": ("weightedmean", "pooling_mode_weightedmean_tokens"),
    "last": ("lasttoken", "pooling_mode_lasttoken"),
}


@dataclass
class Setup:
    base_dir: Path
    adapter_dir: Path
    engine: Engine


def _engine(model_dir: Path, adapter_dir: Path) -> Engine:
    engine = Engine(str(model_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    engine.warmup(256, 128, 16, max_active_adapters=1, max_lora_rank=8)
    engine.lora.load(ADAPTER, "local", str(adapter_dir))
    engine.activate_adapter(ADAPTER, 0)
    return engine


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base_dir = build_tiny_model(tmp_path_factory.mktemp("base"), "llama", seed=11)
    adapter_dir = build_adapter(base_dir, tmp_path_factory.mktemp("adapter") / ADAPTER, seed=12, r=8,
                                lora_alpha=16, target_modules="all-linear")
    yield Setup(base_dir, adapter_dir, _engine(base_dir, adapter_dir))


def _hidden_states(base_dir: Path, adapter_dir: Path | None, prompt: list[int]) -> torch.Tensor:
    """transformers' (peft's, under the adapter) last hidden state of every prompt token."""
    model = peft_reference(base_dir, adapter_dir)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    return out.hidden_states[-1][0]


def _st_pooled(hidden: torch.Tensor, pooling: Pooling, normalize: bool) -> torch.Tensor:
    """sentence-transformers' own modules over one sequence's hidden states."""
    features = {"token_embeddings": hidden[None], "attention_mask": torch.ones(1, hidden.shape[0], dtype=torch.long)}
    features = pooling(features)
    if normalize:
        features = Normalize()(features)
    return features["sentence_embedding"][0]


def _embed(engine: Engine, prompts: list[list[int]], adapter: str = "", generating: list[RequestSpec] = (),
           batch_id: int = 0) -> tuple[list[list[float]], dict[int, int]]:
    blocks = Blocks()
    embeds = [RequestSpec(id=100 + i, input_ids=p, blocks=blocks.table(len(p)), max_new_tokens=0,
                          adapter_id=adapter, embed=True) for i, p in enumerate(prompts)]
    generating = [RequestSpec(id=r.id, input_ids=r.input_ids, blocks=blocks.table(len(r.input_ids) + r.max_new_tokens),
                              max_new_tokens=r.max_new_tokens, adapter_id=r.adapter_id) for r in generating]
    step = engine.prefill(batch_id, [*generating, *embeds])
    by_id = {g.request_id: g for g in step.generations}
    assert sorted(step.request_ids) == sorted(r.id for r in generating), "embeds join no batch"
    if step.request_ids:
        engine.clear_cache(batch_id)
    return [by_id[r.id].embedding for r in embeds], {r.id: by_id[r.id].token_id for r in generating}


def _assert_close(got: list[float], want: torch.Tensor, what: str) -> None:
    got_t = torch.tensor(got)
    cosine = torch.nn.functional.cosine_similarity(got_t, want.float(), dim=0).item()
    assert cosine >= 0.9999, f"{what}: cosine {cosine}"
    torch.testing.assert_close(got_t, want.float(), atol=1e-4, rtol=1e-4, msg=what)


def test_default_pooling_is_the_last_token_normalized(setup: Setup) -> None:
    assert read_pooling(setup.base_dir) == DEFAULT
    assert setup.engine.info.embedding_dim == 64
    assert setup.engine.info.pooling == "last, L2-normalized (default for a causal LM)"
    for adapter, adapter_dir in (("", None), (ADAPTER, setup.adapter_dir)):
        vectors, _ = _embed(setup.engine, PROMPTS, adapter)
        for prompt, vector in zip(PROMPTS, vectors, strict=True):
            want = _st_pooled(_hidden_states(setup.base_dir, adapter_dir, prompt), Pooling(64, "lasttoken"), True)
            _assert_close(vector, want, f"adapter {adapter!r}, prompt of {len(prompt)}")
            assert abs(torch.tensor(vector).norm().item() - 1.0) < 1e-5


def test_embeds_beside_generating_requests_leave_their_tokens_alone(setup: Setup) -> None:
    """One Prefill with generating requests (base and adapter) and embeds of both: the first
    tokens are peft's greedy ones, the embeddings those computed alone."""
    generating = [RequestSpec(id=1, input_ids=PROMPTS[0], blocks=[], max_new_tokens=4),
                  RequestSpec(id=2, input_ids=PROMPTS[2], blocks=[], max_new_tokens=4, adapter_id=ADAPTER)]
    alone, _ = _embed(setup.engine, PROMPTS[:2], ADAPTER)
    mixed, first_tokens = _embed(setup.engine, PROMPTS[:2], ADAPTER, generating, batch_id=7)
    for a, b in zip(alone, mixed, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    base = reference_greedy(peft_reference(setup.base_dir, None), PROMPTS[0], 1)
    tuned = reference_greedy(peft_reference(setup.base_dir, setup.adapter_dir), PROMPTS[2], 1)
    assert first_tokens == {1: base.tokens[0], 2: tuned.tokens[0]}


def _with_st_files(base_dir: Path, target: Path, modules: list[dict], pooling: dict | None) -> Path:
    shutil.copytree(base_dir, target)
    (target / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (target / "1_Pooling").mkdir()
        (target / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return target


def _st_modules(normalize: bool, extra: str | None = None, legacy: bool = False) -> list[dict]:
    """modules.json as sentence-transformers writes it: its releases before 6 named the module
    classes `sentence_transformers.models.X`, later ones by their own modules."""
    names = ["Transformer", "Pooling", *(["Normalize"] if normalize else []), *([extra] if extra else [])]
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    packages = {"Transformer": "base.modules.transformer", "Pooling": "sentence_transformer.modules.pooling",
                "Normalize": "base.modules.normalize", "Dense": "base.modules.dense"}
    return [{"idx": i, "name": str(i), "path": paths[n],
             "type": f"sentence_transformers.models.{n}" if legacy else f"sentence_transformers.{packages[n]}.{n}"}
            for i, n in enumerate(names)]


@pytest.mark.parametrize("mode", list(ST_MODES))
def test_sentence_transformers_pooling_is_followed(setup: Setup, mode: str, tmp_path: Path) -> None:
    """Each pooling, its config in the flags of older releases for half of them and in today's
    `pooling_mode` for the others; the reference is sentence-transformers' Pooling module
    loaded from the same file."""
    normalize = mode in ("mean", "cls", "last")  # with and without a Normalize module
    name, flag = ST_MODES[mode]
    legacy = mode in ("cls", "max", "weighted_mean")
    config = ({"word_embedding_dimension": 64, **{f: f == flag for _, f in ST_MODES.values()}} if legacy
              else {"embedding_dimension": 64, "pooling_mode": name, "include_prompt": True})
    model_dir = _with_st_files(setup.base_dir, tmp_path / "st", _st_modules(normalize, legacy=legacy), config)
    pooling = read_pooling(model_dir)
    assert (pooling.mode, pooling.normalize, pooling.refusal) == (mode, normalize, "")
    reference = Pooling.load(str(model_dir / "1_Pooling"))
    engine = _engine(model_dir, setup.adapter_dir)
    for adapter, adapter_dir in (("", None), (ADAPTER, setup.adapter_dir)):
        vectors, _ = _embed(engine, PROMPTS, adapter)
        for prompt, vector in zip(PROMPTS, vectors, strict=True):
            want = _st_pooled(_hidden_states(setup.base_dir, adapter_dir, prompt), reference, normalize)
            _assert_close(vector, want, f"{mode}, adapter {adapter!r}, prompt of {len(prompt)}")


def test_a_module_the_shard_does_not_apply_refuses_embeddings(setup: Setup, tmp_path: Path) -> None:
    config = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
    model_dir = _with_st_files(setup.base_dir, tmp_path / "dense", _st_modules(True, "Dense"), config)
    engine = _engine(model_dir, setup.adapter_dir)
    assert "sentence_transformers.base.modules.dense.Dense" in engine.info.pooling_refusal
    with pytest.raises(ValueError, match="serves no embeddings.*Dense"):
        _embed(engine, PROMPTS[:1])
    for name, config in (("two", {"embedding_dimension": 64, "pooling_mode": ["mean", "max"]}),
                         ("flags", {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}),
                         ("unknown", {"pooling_mode": "median"})):
        refusal = read_pooling(_with_st_files(setup.base_dir, tmp_path / name, _st_modules(False), config)).refusal
        assert "quiver applies exactly one of cls, mean" in refusal, refusal
    no_prompt = {"pooling_mode": "mean", "include_prompt": False}
    instructor = _with_st_files(setup.base_dir, tmp_path / "instructor", _st_modules(False), no_prompt)
    refusal = read_pooling(instructor).refusal
    assert "include_prompt" in refusal


def test_an_embed_request_computes_its_whole_prompt_and_nothing_else(setup: Setup) -> None:
    blocks = Blocks()
    for extra in ({"cached_tokens": 2}, {"prefill_until": 3}, {"max_new_tokens": 1}, {"prompt_logprobs": 1}):
        request = RequestSpec(id=1, input_ids=PROMPTS[0], blocks=blocks.table(16), embed=True,
                              **{"max_new_tokens": 0, **extra})
        with pytest.raises(ValueError, match="computes its whole prompt"):
            setup.engine.prefill(50, [request])
