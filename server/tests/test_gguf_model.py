"""A GGUF file as a transformers checkpoint (`quant/gguf_model.py`): the q/k row order put back
as transformers' GGUF loader puts it back (its own LlamaTensorProcessor is the reference), and
architectures not served yet refused by name. The whole mapping on a real file — every tensor
of the demo's Q4_1 GGUF equal to transformers' dequantized checkpoint — is checked by
integration-tests/test_gguf_served.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from quiver_server.quant.gguf_model import gguf_config, iter_gguf_tensors, rotary_rows


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 8), (8, 2, 16)])
def test_rotary_rows_are_transformers_reverse_permutation(heads, kv_heads, head_dim) -> None:
    processor = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    for name, rows in (("blk.0.attn_q.weight", heads * head_dim), ("blk.0.attn_k.weight", kv_heads * head_dim)):
        weights = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
        expected = processor.process(weights, name).weights
        count = heads if "attn_q" in name else kv_heads
        np.testing.assert_array_equal(torch.from_numpy(weights)[rotary_rows(rows, count)].numpy(), expected)


def test_architectures_not_served_are_named(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    writer = GGUFWriter(str(path), "gemma2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gemma2' is not served yet"):
        gguf_config(path)
    with pytest.raises(ValueError, match="'gemma2' is not served yet"):
        next(iter_gguf_tensors(path))
