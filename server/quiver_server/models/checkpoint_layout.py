"""Which of transformers' two layouts a decoder checkpoint is saved in.

`save_pretrained` of a causal LM (`Qwen3ForCausalLM`) names its backbone's tensors under
`model.` (model.layers.0.self_attn.q_proj.weight) beside `lm_head.weight`. Of the bare backbone
(`Qwen3Model`, `MistralModel`: what sentence-transformers saves, and how decoder embedding
models such as Qwen3-Embedding and e5-mistral are published) it names them without the prefix
(layers.0.self_attn.q_proj.weight) and has no LM head. The decoder loads both, as transformers
does, by putting the prefix back. A bare checkpoint with tied embeddings still generates (its
embedding matrix is the head); an untied one has no head at all, and serves embeddings only, as
vLLM serves such a model as a pooling model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quiver_server.gguf_source import source_of
from quiver_server.weights import tensor_names

# The module a causal LM holds its backbone under (transformers' `base_model_prefix`), as the
# decoder does too (`DecoderForCausalLM.model`).
BACKBONE = "model."


@dataclass(frozen=True)
class CheckpointLayout:
    bare: bool  # a bare backbone's checkpoint: no `model.` prefix, no LM head

    def causal_lm_name(self, name: str) -> str:
        """A tensor's name as a causal LM's checkpoint gives it."""
        return BACKBONE + name if self.bare else name


CAUSAL_LM = CheckpointLayout(bare=False)


def checkpoint_layout(model_dir: Path) -> CheckpointLayout:
    """The layout of the checkpoint in `model_dir`, told by its tensor names: they, not
    config.json's `architectures`, are what loading depends on."""
    if source_of(model_dir) is not None:
        return CAUSAL_LM  # a GGUF file's tensors are renamed as a causal LM's (quant.gguf_model)
    return CheckpointLayout(bare=not any(name.startswith(BACKBONE) for name in tensor_names(model_dir)))


def no_lm_head_refusal(model_type: str) -> str:
    """Why a model without an LM head refuses to generate: said by the shard's log and by every
    generating request it refuses."""
    return (f"this {model_type} checkpoint is a bare base model (no lm_head.weight, untied embeddings), "
            "so it has no LM head to generate with: it serves embeddings only")
