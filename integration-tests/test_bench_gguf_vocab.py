"""The SentencePiece form of the bench vocabulary (bench/peers/gguf_convert.py), which llama.cpp's
converter turns into the GGUF's vocabulary, keeps every token id of the bench tokenizer: read back
by sentencepiece itself, each id is the same kind of token and decodes to the same word as the
bench tokenizer (transformers) decodes it."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from bench.fixtures import bench_model
from bench.peers import gguf_convert

VOCAB = 32000


@pytest.fixture(scope="module")
def sentencepiece_and_bench(tmp_path_factory):
    from sentencepiece import SentencePieceProcessor

    root = tmp_path_factory.mktemp("vocab")
    bench_model.write_tokenizer(root, VOCAB)
    gguf_convert.write_sentencepiece_model(root / "tokenizer.model", VOCAB)
    processor = SentencePieceProcessor()
    processor.LoadFromFile(str(root / "tokenizer.model"))
    return processor, AutoTokenizer.from_pretrained(root)


def test_every_id_decodes_to_the_bench_word(sentencepiece_and_bench):
    processor, bench = sentencepiece_and_bench
    assert processor.vocab_size() == len(bench) == VOCAB
    ids = list(range(len(bench_model.SPECIAL), VOCAB))
    assert [processor.DecodeIds([i]) for i in ids] == [bench.decode([i]) for i in ids]
    # Whole sequences too: the words the greedy check compares, space-separated.
    sample = ids[::997]
    assert processor.DecodeIds(sample).split() == bench.decode(sample).split()


def test_special_tokens_keep_their_ids_and_kinds(sentencepiece_and_bench):
    processor, bench = sentencepiece_and_bench
    assert processor.unk_id() == bench.unk_token_id == 0
    assert processor.bos_id() == bench.bos_token_id == 1
    assert processor.eos_id() == bench.eos_token_id == 2
    assert processor.IsUnknown(0) and processor.IsControl(1) and processor.IsControl(2)
    assert not any(processor.IsControl(i) or processor.IsUnknown(i) for i in range(3, VOCAB))
