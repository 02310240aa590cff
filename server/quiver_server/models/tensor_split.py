"""How a decoder splits over tensor-parallel ranks (`parallel.TensorParallel`): the per-rank
config its layers are built from, and which checkpoint rows and columns each rank loads.

- Attention: rank r keeps query heads [r H/N, (r + 1) H/N) and their KV heads. KV heads split the
  same way when N divides them; when there are fewer KV heads than ranks (N a multiple of them),
  each rank keeps the one KV head its query heads read, so a KV head is held by N / KV ranks.
  q/k/v are split by output rows, o by input columns.
- MLP: gate/up by output rows, down by input columns, each rank a 1/N slice of the intermediate
  size.
- Sparse MLPs: every rank holds every expert, each a 1/N slice of its intermediate size (split as
  the dense MLP is, per expert), and the router whole; the experts' partial sum takes one
  all-reduce, as the dense MLP's does. (Expert parallelism, whole experts per rank, would leave a rank
  idle whenever the batch's tokens route away from its experts; at the batch sizes one server
  decodes, slicing every expert keeps the ranks' work equal.)
- What a rank's o and down add up is partial: the model sums it over the ranks (one all-reduce
  each); their biases load on rank 0 only, so the sum adds them once.

Shapes that cannot split (heads, KV heads or the intermediate size not divisible) are refused at
load with the number that does not divide. Checkpoints that store q/k/v or gate/up fused (Phi-3)
split the same way: a rank loads its rows of each part of the fused tensor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quiver_server.models.decoder_config import DecoderConfig
from quiver_server.parallel import RowSpans, TensorParallel


@dataclass(frozen=True)
class AttentionSplit:
    q_rows: slice  # checkpoint rows of q_proj (and o_proj's input columns)
    kv_rows: slice  # checkpoint rows of k_proj and v_proj
    q_width: int  # the whole q_proj's rows
    kv_width: int  # the whole k_proj's (and v_proj's)

    def qkv_parts(self, fused: bool) -> tuple[dict[str, RowSpans], dict[str, int]]:
        """The q/k/v Linear's held rows and whole widths, per checkpoint part: q_proj, k_proj and
        v_proj, or one qkv_proj whose q, k and v rows sit one after another (Phi-3)."""
        if not fused:
            return ({"q_proj": (self.q_rows,), "k_proj": (self.kv_rows,), "v_proj": (self.kv_rows,)},
                    {"q_proj": self.q_width, "k_proj": self.kv_width, "v_proj": self.kv_width})
        k_start, v_start = self.q_width, self.q_width + self.kv_width
        rows = (self.q_rows, slice(k_start + self.kv_rows.start, k_start + self.kv_rows.stop),
                slice(v_start + self.kv_rows.start, v_start + self.kv_rows.stop))
        return {"qkv_proj": rows}, {"qkv_proj": self.q_width + 2 * self.kv_width}


@dataclass(frozen=True)
class LayerSplits:
    """What every layer of a split model holds of the checkpoint's projections."""

    attention: AttentionSplit
    mlp_rows: slice
    expert_rows: slice | None  # sparse MLPs only


def layer_splits(cfg: DecoderConfig, tp: TensorParallel) -> LayerSplits | None:
    """None for a whole model (one rank)."""
    if tp.size == 1:
        return None
    return LayerSplits(attention_split(cfg, tp), mlp_rows(cfg, tp),
                       expert_rows(cfg, tp) if cfg.moe is not None else None)


def local_config(cfg: DecoderConfig, tp: TensorParallel) -> DecoderConfig:
    """The config of this rank's layers: its heads, KV heads and MLP slice (everything else whole)."""
    if tp.size == 1:
        return cfg
    heads = tp.span(cfg.num_heads, "attention heads")
    kv = attention_split(cfg, tp).kv_rows
    intermediate = tp.span(cfg.intermediate_size, "MLP columns (intermediate_size)")
    moe = cfg.moe
    if moe is not None:
        experts = expert_rows(cfg, tp)
        moe = dataclasses.replace(moe, intermediate_size=experts.stop - experts.start)
    return dataclasses.replace(
        cfg, num_heads=heads.stop - heads.start, num_kv_heads=(kv.stop - kv.start) // cfg.head_dim,
        intermediate_size=intermediate.stop - intermediate.start, moe=moe)


def attention_split(cfg: DecoderConfig, tp: TensorParallel) -> AttentionSplit:
    heads = tp.span(cfg.num_heads, "attention heads")
    d = cfg.head_dim
    if cfg.num_kv_heads % tp.size == 0:
        kv = tp.span(cfg.num_kv_heads, "KV heads")
    elif tp.size % cfg.num_kv_heads == 0:
        first = tp.rank * cfg.num_kv_heads // tp.size  # the KV head this rank's query heads read
        kv = slice(first, first + 1)
    else:
        raise ValueError(f"KV heads ({cfg.num_kv_heads}) do not split over {tp.size} shards, nor does "
                         f"{tp.size} split into copies of them: --num-shard must divide one by the other")
    return AttentionSplit(slice(heads.start * d, heads.stop * d), slice(kv.start * d, kv.stop * d),
                          cfg.num_heads * d, cfg.num_kv_heads * d)


def mlp_rows(cfg: DecoderConfig, tp: TensorParallel) -> slice:
    """Checkpoint rows of gate_proj and up_proj (and down_proj's input columns)."""
    return tp.span(cfg.intermediate_size, "MLP columns (intermediate_size)")


def expert_rows(cfg: DecoderConfig, tp: TensorParallel) -> slice:
    """Checkpoint rows of every expert's gate_proj and up_proj (and its down_proj's input columns)."""
    assert cfg.moe is not None
    return tp.span(cfg.moe.intermediate_size, "expert columns (moe_intermediate_size)")
