"""The per-step mask against llguidance's own one-byte-per-token mask, and the rules for matchers
that cannot go on: a completed or failed matcher allows only EOS; ids past the tokenizer's
vocabulary never; free rows are left out of the mask and untouched by it; a background advance
is done before the next fill reads the matchers."""

from __future__ import annotations

from pathlib import Path

from collections.abc import Sequence

import llguidance
import pytest
import torch
from grammar_models import EOS, MODEL_VOCAB, TOKENIZER_VOCAB, build_grammar_model
from tokenizers import Tokenizer

from quiver_server.grammar.masks import GrammarMasks, StepMask
from quiver_server.grammar.tokenizers import TokenizerCache, base_source

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer]:
    return build_grammar_model(tmp_path_factory.mktemp("grammar-masks"))


@pytest.fixture(scope="module")
def lltokenizer(model: tuple[Path, Tokenizer]) -> llguidance.LLTokenizer:
    return TokenizerCache(MODEL_VOCAB).get(base_source(model[0]), (EOS,))


def _matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _allowed_ids(row: torch.Tensor) -> list[int]:
    return row.nonzero().flatten().tolist()


def _allowed(step: StepMask) -> torch.Tensor:
    """[len(rows), V] bool: the tokens the step's bias lets through (0, not -inf)."""
    return step.bias == 0


def _step_mask(masks: GrammarMasks, matchers: Sequence[llguidance.LLMatcher | None]) -> StepMask | None:
    """A batch's mask as the engine takes it: the fill started, then waited for."""
    pending = masks.start(matchers)
    return pending.wait(CPU) if pending is not None else None


def _advance(masks: GrammarMasks, matchers: Sequence[llguidance.LLMatcher | None], tokens: Sequence[int]) -> None:
    """Each matcher consumes its row's token as the engine has it do (in the background), done
    here before returning: a fill queued behind the advance, waited for, raises its error."""
    masks.advance_in_background(matchers, tokens)
    _step_mask(masks, matchers)


def test_the_mask_is_llguidances_and_free_rows_are_left_out(lltokenizer: llguidance.LLTokenizer) -> None:
    json_mode = _matcher(lltokenizer, llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}))
    regex = _matcher(lltokenizer, llguidance.LLMatcher.grammar_from_regex("[0-9]+(cm|mm)"))
    masks = GrammarMasks(MODEL_VOCAB)
    step = _step_mask(masks, [json_mode, None, regex])
    assert step is not None and step.rows == [0, 2]
    assert step.bias.shape == (2, MODEL_VOCAB) and step.bias.dtype == torch.float32
    # Exactly 0 where allowed (adding it changes no score) and -inf elsewhere.
    assert set(step.bias.unique().tolist()) == {0.0, float("-inf")}
    allowed = _allowed(step)
    for mask_row, matcher in ((0, json_mode), (1, regex)):
        reference = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8) != 0
        assert torch.equal(allowed[mask_row, : reference.numel()], reference[:MODEL_VOCAB])
        assert not allowed[mask_row, TOKENIZER_VOCAB:].any(), "ids past the tokenizer's vocabulary"
        assert 0 < int(allowed[mask_row].sum()) < TOKENIZER_VOCAB
    assert _step_mask(masks, [None, None]) is None


def test_applying_a_mask_leaves_the_scores_it_was_given(lltokenizer: llguidance.LLTokenizer) -> None:
    regex = _matcher(lltokenizer, llguidance.LLMatcher.grammar_from_regex("[0-9]+"))
    step = _step_mask(GrammarMasks(MODEL_VOCAB), [None, regex, None])
    assert step is not None
    logits = torch.randn(3, MODEL_VOCAB)
    before = logits.clone()
    masked = step.apply(logits)
    allowed = _allowed(step)
    assert torch.equal(logits, before)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.equal(masked[1].isfinite(), allowed[0])
    assert torch.equal(masked[1][allowed[0]], logits[1][allowed[0]])
    assert torch.equal(step.mask_rows(logits[1:2]), masked[1:2])


def test_a_background_advance_is_done_before_the_next_mask(
    lltokenizer: llguidance.LLTokenizer, model: tuple[Path, Tokenizer]
) -> None:
    tokenizer = model[1]
    masks = GrammarMasks(MODEL_VOCAB)
    matcher = _matcher(lltokenizer, llguidance.LLMatcher.grammar_from_regex("ab"))
    masks.advance_in_background([None, matcher], [0, tokenizer.encode("a").ids[0]])
    step = _step_mask(masks, [None, matcher])
    assert step is not None
    assert {tokenizer.decode([t]) for t in _allowed_ids(_allowed(step)[0])} == {"b"}


def test_complete_and_failed_matchers_allow_only_eos(
    lltokenizer: llguidance.LLTokenizer, model: tuple[Path, Tokenizer]
) -> None:
    tokenizer = model[1]
    masks = GrammarMasks(MODEL_VOCAB)
    complete = _matcher(lltokenizer, llguidance.LLMatcher.grammar_from_regex("abc"))
    failed = _matcher(lltokenizer, llguidance.LLMatcher.grammar_from_regex("abc"))
    partial = _matcher(lltokenizer, llguidance.LLMatcher.grammar_from_regex("abc"))
    _advance(masks, [complete, failed, partial], [tokenizer.encode("a").ids[0]] * 3)
    for token in tokenizer.encode("bc").ids:
        _advance(masks, [complete], [token])
    _advance(masks, [failed], [tokenizer.encode("z").ids[0]])
    assert complete.is_stopped() and not complete.is_error()
    assert failed.is_error()
    step = _step_mask(masks, [complete, failed, partial])
    assert step is not None
    allowed = _allowed(step)
    assert _allowed_ids(allowed[0]) == [EOS]
    assert _allowed_ids(allowed[1]) == [EOS]
    assert EOS not in _allowed_ids(allowed[2])
    allowed_text = {tokenizer.decode([t]) for t in _allowed_ids(allowed[2])}
    assert allowed_text and all("bc".startswith(t) for t in allowed_text), allowed_text
