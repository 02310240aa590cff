"""The decoder every served family is built from, on the paged KV cache.

A family declares its pieces in a `DecoderConfig` (norm form, q/k norms, sandwich norms,
activation, rotary per layer, sliding windows, soft-capping, Granite's multipliers, a dense or
sparse MLP) and its weight names in a `ProjectionLayout`; `DecoderForCausalLM` subclasses add
only that (see `models/llama.py` for the smallest). Module and parameter names mirror
transformers' (model.layers.N.self_attn...), except that q/k/v and gate/up are fused into one
`Linear` each where the checkpoint stores them apart; `load_weights` maps checkpoint names onto
the fused parts (a bare base model's names first get the causal LM's `model.` prefix:
`checkpoint_layout`). The ops (C++ kernels on CPU, torch elsewhere) are the shard's `KernelOps`,
chosen once at load and handed to every layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from quiver_server.engine.forward_batch import ForwardBatch
from quiver_server.kernels import cpu_gemm, quant_gemm
from quiver_server.kernels.ops import KernelOps
from quiver_server.engine.kv_cache import PagedKVCache
from quiver_server.layers.activation import gated_activation
from quiver_server.layers.linear import Linear
from quiver_server.layers.norm import make_norm
from quiver_server.layers.rotary import RotaryEmbedding
from quiver_server.models.checkpoint_layout import CAUSAL_LM, CheckpointLayout, checkpoint_layout, no_lm_head_refusal
from quiver_server.models.decoder_config import DecoderConfig
from quiver_server.models.family import ProjectionLayout
from quiver_server.models.moe import SparseMoe
from quiver_server.models.tensor_split import AttentionSplit, LayerSplits, layer_splits, local_config
from quiver_server.parallel import SINGLE, TensorParallel
from quiver_server.gguf_source import source_of
from quiver_server.quant.fp8_checkpoint import Fp8Format, dequantized_fp8_tensors
from quiver_server.quant.prequantized import PrequantizedFormat, checkpoint_quantization, group_quantized_tensors
from quiver_server.quant.quantize import QuantizeSpec
from quiver_server.quant.weights import QuantizedWeight
from quiver_server.weights import CheckpointTensor, ReadTally, UnreadTensor, iter_tensors, read_whole

Loader = Callable[[torch.Tensor | UnreadTensor], None]
log = logging.getLogger(__name__)
CosSin = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_index: int, ops: KernelOps, tp: TensorParallel = SINGLE,
                 split: AttentionSplit | None = None) -> None:
        """cfg: this rank's (tensor_split.local_config); split: which checkpoint rows it holds."""
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.scale
        self.softcap = cfg.attention_softcap
        self.sliding_window = cfg.sliding_windows[layer_index]
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        parts = ({"qkv_proj": q_width + 2 * kv_width} if cfg.fused_checkpoint
                 else {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width})
        self.qkv_proj = Linear(cfg.hidden_size, parts, bias=cfg.qkv_bias, ops=ops)
        self.o_proj = Linear(q_width, {"o_proj": cfg.hidden_size}, bias=cfg.o_bias, ops=ops)
        if split is not None:
            self.qkv_proj.split_by_output(*split.qkv_parts(cfg.fused_checkpoint))
            self.o_proj.split_by_input(split.q_rows, split.q_width, tp.rank == 0, tp.all_reduce_max)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg.norm, cfg.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = make_norm(cfg.norm, cfg.head_dim, cfg.rms_norm_eps, ops)

    def forward(
        self, x: torch.Tensor, cos_sin: CosSin, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rows: if given, only these tokens' outputs are computed past attention (their K/V
        are still written for every token)."""
        tokens = x.shape[0]
        q, k, v = self.store_kv(x, cos_sin, batch, k_cache, v_cache)
        if batch.mixed is not None:
            # Prompt rows, then one decode row per running sequence, each through its own kernel.
            split, at = batch.mixed, batch.mixed.prefill_tokens
            out = torch.cat((
                self.ops.prefill_attention(q[:at], k[:at], v[:at], split.head, self.scale, self.sliding_window,
                                           k_cache, v_cache, self.softcap),
                self.ops.decode_attention(q[at:], k_cache, v_cache, split.tail, self.scale, self.sliding_window,
                                          self.softcap),
            ))
        elif batch.is_prefill:
            # Every token's K/V of this layer is in the cache before any sequence reads it back.
            out = self.ops.prefill_attention(q, k, v, batch, self.scale, self.sliding_window, k_cache, v_cache,
                                             self.softcap)
        else:
            out = self.ops.decode_attention(q, k_cache, v_cache, batch, self.scale, self.sliding_window, self.softcap)
        out = out.reshape(tokens, self.num_heads * self.head_dim)
        # Split by input, each rank's o_proj (its LoRA delta included) is a partial sum.
        if rows is None:
            return self.tp.all_reduce(self.o_proj(out, batch))
        return self.tp.all_reduce(self.o_proj(out[rows], batch.at_logits_rows()))

    def store_kv(
        self, x: torch.Tensor, cos_sin: CosSin, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projects x to q, k, v (normed and rotated), writes k and v into the cache, returns all three."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x, batch).view(x.shape[0], heads + 2 * kv_heads, self.head_dim)
        qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        # q and k heads sit side by side, so one rotary application covers both (on their leading
        # rotary_dim columns: Phi-4-mini's partial rotary); the turned k and v then go to the cache.
        qk = self.ops.rotary_and_write_kv(qk, v, *cos_sin, k_cache, v_cache, batch.slot_mapping)
        return qk[:, :heads], qk[:, heads:], v


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, ops: KernelOps, tp: TensorParallel = SINGLE,
                 split_rows: slice | None = None) -> None:
        super().__init__()
        self.tp = tp
        width = cfg.intermediate_size
        parts = {"gate_up_proj": 2 * width} if cfg.fused_checkpoint else {"gate_proj": width, "up_proj": width}
        self.gate_up_proj = Linear(cfg.hidden_size, parts, bias=cfg.mlp_bias, ops=ops)
        self.down_proj = Linear(width, {"down_proj": cfg.hidden_size}, bias=cfg.mlp_bias, ops=ops)
        self.act = gated_activation(cfg.activation, ops)
        if split_rows is not None:
            whole = width * tp.size
            if cfg.fused_checkpoint:  # gate|up in one tensor: this rank's rows of each
                up_rows = slice(whole + split_rows.start, whole + split_rows.stop)
                self.gate_up_proj.split_by_output({"gate_up_proj": (split_rows, up_rows)}, {"gate_up_proj": 2 * whole})
            else:
                self.gate_up_proj.split_by_output({"gate_proj": (split_rows,), "up_proj": (split_rows,)},
                                                  {"gate_proj": whole, "up_proj": whole})
            self.down_proj.split_by_input(split_rows, whole, tp.rank == 0, tp.all_reduce_max)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x, batch)), batch))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_index: int, ops: KernelOps, tp: TensorParallel = SINGLE,
                 splits: LayerSplits | None = None) -> None:
        super().__init__()
        self.rope_index = cfg.layer_ropes[layer_index]
        self.residual_multiplier = cfg.residual_multiplier
        self.input_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, layer_index, ops, tp, splits.attention if splits else None)
        self.post_attention_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps, ops)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps, ops)
            self.post_feedforward_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.sandwich = cfg.sandwich_norms
        self.mlp: nn.Module = (SparseMoe(cfg, ops, tp, splits.expert_rows if splits else None)
                               if cfg.is_moe_layer(layer_index)
                               else MLP(cfg, ops, tp, splits.mlp_rows if splits else None))

    def forward(
        self, x: torch.Tensor, ropes: list[CosSin], batch: ForwardBatch, k_cache: torch.Tensor,
        v_cache: torch.Tensor, rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), ropes[self.rope_index], batch, k_cache, v_cache, rows)
        if rows is not None:
            x, batch = x[rows], batch.at_logits_rows()
        # The residual add and the next norm in one pass where the ops fuse them.
        if self.sandwich:
            h, x = self.pre_feedforward_layernorm.add_and_norm(
                self.post_attention_layernorm(attended), x, self.residual_multiplier)
            return self._residual(x, self.post_feedforward_layernorm(self.mlp(h, batch)))
        h, x = self.post_attention_layernorm.add_and_norm(attended, x, self.residual_multiplier)
        return self._residual(x, self.mlp(h, batch))

    def _residual(self, x: torch.Tensor, block_out: torch.Tensor) -> torch.Tensor:
        if self.residual_multiplier != 1.0:
            return x + block_out * self.residual_multiplier
        return x + block_out

    def store_kv(
        self, x: torch.Tensor, ropes: list[CosSin], batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> None:
        """Only what later passes need of this layer: the K/V of x's tokens, into the cache."""
        self.self_attn.store_kv(self.input_layernorm(x), ropes[self.rope_index], batch, k_cache, v_cache)


class Backbone(nn.Module):
    def __init__(self, cfg: DecoderConfig, ops: KernelOps, tp: TensorParallel = SINGLE,
                 splits: LayerSplits | None = None) -> None:
        super().__init__()
        # Storage given up front: the loader fills it, and initialising it on the meta device
        # would import torch._dynamo (seconds of every shard start) for nothing. Split over
        # ranks, each holds its span of the vocabulary's rows (`vocab_rows`).
        rows = vocab_rows(cfg.vocab_size, tp)
        self.embed_tokens = nn.Embedding(rows.stop - rows.start, cfg.hidden_size,
                                         _weight=torch.empty(rows.stop - rows.start, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops, tp, splits) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps, ops)


class DecoderForCausalLM(nn.Module):
    """A family subclasses this with its `MODEL_TYPES`, `layout` and `config_from_hf`, and
    `checkpoint_name` where its checkpoint names differ from the module names."""

    layout: ClassVar[ProjectionLayout]

    def __init__(self, cfg: DecoderConfig, ops: KernelOps, tp: TensorParallel = SINGLE) -> None:
        """cfg: the whole model's; split over `tp`'s ranks, `config` is this rank's share of it
        (tensor_split.local_config: its heads and MLP slice; the vocabulary stays whole)."""
        super().__init__()
        self.config = local_config(cfg, tp)
        self.ops = ops
        self.tp = tp
        self.model = Backbone(self.config, ops, tp, layer_splits(cfg, tp))
        self.vocab_rows = vocab_rows(cfg.vocab_size, tp)
        self.lm_head = (nn.Linear(cfg.hidden_size, self.vocab_rows.stop - self.vocab_rows.start, bias=False)
                        if cfg.has_lm_head else None)
        self.rotaries: list[RotaryEmbedding] = []  # built on the target device by `load`
        self.lm_head_packed: cpu_gemm.PackedWeight | None = None  # CPU: the LM head prepacked, see `load`
        self.lm_head_quant: quant_gemm.PackedQuantWeight | None = None  # --quantize-lm-head
        self.checkpoint_read = ReadTally()  # of a safetensors checkpoint: its bytes, and what this rank read

    @classmethod
    def config_from_hf(cls, config: dict[str, Any]) -> DecoderConfig:
        raise NotImplementedError

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        """A checkpoint tensor's name as this model's modules name it."""
        return name

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """input_ids [T] (flattened batch) -> logits [len(batch.logits_indices), vocab]
        (decode: logits_indices is every row). A prefill without logits rows (every sequence a
        chunk of an unfinished prompt) only writes the K/V: the last layer stops there and the
        LM head does not run."""
        if self.lm_head is None:  # the engine refuses generating requests before they get here
            raise ValueError(no_lm_head_refusal(self.config.model_type))
        x, ropes = self._inputs(input_ids, batch)
        cfg = self.config
        layers = self.model.layers
        last = len(layers) - 1
        if batch.is_prefill and batch.logits_indices.shape[0] == 0:
            for index in range(last):
                x = layers[index](x, ropes, batch, kv_cache.k[index], kv_cache.v[index])
            final = layers[last]
            assert isinstance(final, DecoderLayer)
            final.store_kv(x, ropes, batch, kv_cache.k[last], kv_cache.v[last])
            return x.new_empty(0, cfg.vocab_size)
        for index, layer in enumerate(layers):
            # Past the last layer's attention only the rows whose logits are wanted matter:
            # in a prefill that skips the o_proj and MLP of every other prompt token.
            rows = batch.logits_indices if index == last and batch.is_prefill else None
            x = layer(x, ropes, batch, kv_cache.k[index], kv_cache.v[index], rows)
        x = self.model.norm(x)  # decode: every row is wanted
        if self.lm_head_quant is not None:
            logits = quant_gemm.linear(x, self.lm_head_quant, None)
        elif self.lm_head_packed is not None:
            logits = cpu_gemm.linear(x, self.lm_head_packed, None)
        else:
            logits = self.lm_head(x)
        if self.tp.size > 1:  # each rank's vocabulary rows, side by side (the last span padded)
            logits = self.tp.all_gather_columns(logits)[:, : cfg.vocab_size]
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def hidden_states(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """input_ids [T] -> every token's final normed hidden state [T, hidden] (transformers'
        `last_hidden_state`): embeddings are pooled from these. The K/V are written as a prefill
        writes them; no LM head runs."""
        x, ropes = self._inputs(input_ids, batch)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, ropes, batch, kv_cache.k[index], kv_cache.v[index])
        return self.model.norm(x)

    def _inputs(self, input_ids: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, list[CosSin]]:
        """The first layer's input (embedding rows, scaled where the family scales them) and each
        rotary's cos/sin at the batch's positions."""
        assert self.rotaries, "use DecoderForCausalLM.load"
        cfg = self.config
        x = self._embed(input_ids)
        if cfg.embed_scale != 1.0:
            x = x * (torch.tensor(cfg.embed_scale, dtype=x.dtype) if cfg.embed_scale_in_dtype else cfg.embed_scale)
        ends = batch.sequence_ends() if any(r.needs_sequence_ends for r in self.rotaries) else None
        return x, [rotary.cos_sin(batch.positions, x.dtype, ends) for rotary in self.rotaries]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of input_ids; split over ranks, each rank looks up the ids in its
        span (zeros elsewhere) and the sum over ranks is each id's one row, exactly."""
        if self.tp.size == 1:
            return self.model.embed_tokens(input_ids)
        local = input_ids - self.vocab_rows.start
        outside = (local < 0) | (local >= self.vocab_rows.stop - self.vocab_rows.start)
        x = self.model.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    @classmethod
    def load(
        cls, model_dir: Path, config: dict[str, Any], dtype: torch.dtype, ops: KernelOps,
        quantize: QuantizeSpec | None = None, tp: TensorParallel = SINGLE,
    ) -> DecoderForCausalLM:
        cfg = cls.config_from_hf(config)
        layout = checkpoint_layout(model_dir)
        if layout.bare and not cfg.tie_word_embeddings:
            log.warning("%s", no_lm_head_refusal(cfg.model_type))
            cfg = replace(cfg, has_lm_head=False)
        device = ops.device
        # Before any weight is read: an unsupported quantization_config fails here, by name.
        prequantized = checkpoint_quantization(config)
        packed = prequantized if isinstance(prequantized, PrequantizedFormat) else None
        if quantize is not None and (packed is not None or source_of(model_dir) is not None):
            raise ValueError("--quantize quantizes a float checkpoint; this one is already quantized "
                             f"({packed.method if packed else 'GGUF'}) and serves in its own format")
        with torch.device("meta"):
            model = cls(cfg, ops, tp)
        # Allocate uninitialised storage directly in the target dtype; the checkpoint fills it.
        model = model.to(dtype).to_empty(device=device)
        if cfg.tie_word_embeddings and model.lm_head is not None:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.rotaries = [RotaryEmbedding(rope, cfg.head_dim, device) for rope in cfg.ropes]
        tensors: Iterable[tuple[str, CheckpointTensor]]
        if isinstance(prequantized, Fp8Format):  # dense after load: --quantize may requantize it
            tensors = dequantized_fp8_tensors(iter_tensors(model_dir, device), prequantized)
        elif packed is not None:
            tensors = group_quantized_tensors(iter_tensors(model_dir, device), packed)
        else:  # each tensor unread until a loader reads its share (a split model's rank: its rows)
            tensors = iter_tensors(model_dir, device, unread_into=model.checkpoint_read)
        model.load_weights(tensors, layout)
        if tp.size > 1 and model.checkpoint_read.total:
            log.info("rank %d read %.1f MiB of the checkpoint's %.1f MiB", tp.rank,
                     model.checkpoint_read.read / 2**20, model.checkpoint_read.total / 2**20)
        model.pack_weights(quantize)
        return model.eval()

    def pack_weights(self, quantize: QuantizeSpec | None = None) -> None:
        """Every projection and the LM head on prepacked weights where the ops pack them (float32
        on CPU, `kernels.cpu_gemm`); projections quantized where they loaded quantized or
        `quantize` asks (the embeddings and MoE experts stay in the model dtype, and the LM
        head unless `quantize.lm_head`). A tied LM head packs a copy: the embedding lookup still
        needs the plain table."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_weight(quantize)
        if self.lm_head is None:
            return
        if quantize is not None and quantize.lm_head:
            self.lm_head_quant = self.ops.pack_quantized(quantize.apply(self.lm_head.weight.data))
        else:
            self.lm_head_packed = self.ops.pack(self.lm_head.weight)
        if (self.lm_head_packed is not None or self.lm_head_quant is not None) and not self.config.tie_word_embeddings:
            self.lm_head.register_parameter("weight", None)

    def quantized_weights(self) -> list[quant_gemm.PackedQuantWeight]:
        """The packed quantized weights: every quantized projection's, and the LM head's."""
        weights = [m.quant_weight for m in self.modules() if isinstance(m, Linear) and m.quant_weight is not None]
        return weights + ([self.lm_head_quant] if self.lm_head_quant is not None else [])

    def checkpoint_loaders(self) -> dict[str, Loader]:
        """Every tensor name a transformers checkpoint of this config must contain (in this
        model's naming, see `checkpoint_name`) -> what stores it."""
        loaders: dict[str, Loader] = {}
        sparse = [name for name, module in self.named_modules() if isinstance(module, SparseMoe)]
        for module_name, module in self.named_modules():
            if isinstance(module, SparseMoe):
                loaders.update(module.checkpoint_loaders(module_name))
            elif any(module_name.startswith(f"{prefix}.") for prefix in sparse):
                continue  # the sparse MLP names its own tensors
            elif isinstance(module, Linear):
                loaders.update(_linear_loaders(module_name, module))
            else:
                for name, param in module.named_parameters(recurse=False):
                    loaders[f"{module_name}.{name}"] = _copy_into(f"{module_name}.{name}", param)
        if self.tp.size > 1:  # the vocabulary's rows are split
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                if name in loaders:
                    loaders[name] = _copy_rows_into(name, self.get_parameter(name), self.vocab_rows)
        if self.config.tie_word_embeddings:
            loaders.pop("lm_head.weight", None)
        return loaders

    def load_weights(self, tensors: Iterable[tuple[str, CheckpointTensor]],
                     layout: CheckpointLayout = CAUSAL_LM) -> None:
        """Every checkpoint tensor into place, its name read in the checkpoint's `layout`. A
        quantized one (GGUF, AWQ/GPTQ) stays quantized where it is a projection's weight
        (`Linear`); anywhere else (embeddings, MoE experts) it is dequantized into the model's
        float parameter."""
        loaders = self.checkpoint_loaders()
        quantized_loaders = self._quantized_loaders()
        loaded: set[str] = set()
        for checkpoint_name, tensor in tensors:
            if checkpoint_name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints store the (recomputed) RoPE buffer
            name = self.checkpoint_name(layout.causal_lm_name(checkpoint_name))
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still carry a copy
            loader = loaders.get(name)
            if loader is None:
                raise ValueError(f"unexpected tensor {checkpoint_name!r} in checkpoint for {self.config.model_type}")
            if isinstance(tensor, QuantizedWeight):
                keep = quantized_loaders.get(name)
                if keep is not None:
                    keep(tensor)
                else:
                    loader(tensor.dequantize())
            else:
                loader(tensor)
            loaded.add(name)
        missing = sorted(set(loaders) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


    def _quantized_loaders(self) -> dict[str, Callable[[QuantizedWeight], None]]:
        """The checkpoint names whose quantized weights a `Linear` keeps quantized."""
        sparse = [name for name, module in self.named_modules() if isinstance(module, SparseMoe)]
        loaders: dict[str, Callable[[QuantizedWeight], None]] = {}
        for module_name, module in self.named_modules():
            if isinstance(module, Linear) and not any(module_name.startswith(f"{p}.") for p in sparse):
                parent = module_name.rpartition(".")[0]
                for part in module.parts:
                    loaders[f"{parent}.{part}.weight"] = partial(module.load_part, part, "weight")
        return loaders


def _linear_loaders(module_name: str, linear: Linear) -> dict[str, Loader]:
    """A fused Linear's parts load under their checkpoint names, siblings of the Linear."""
    parent = module_name.rpartition(".")[0]
    kinds = ("weight", "bias") if linear.bias is not None else ("weight",)
    def loader(part: str, kind: str) -> Loader:
        return lambda tensor: linear.load_part(part, kind, tensor)

    return {f"{parent}.{part}.{kind}": loader(part, kind) for part in linear.parts for kind in kinds}


def vocab_rows(vocab_size: int, tp: TensorParallel) -> slice:
    """The vocabulary rows of the embedding and LM head a rank holds: equal spans of
    ceil(vocab / ranks), the last one padded with zero rows past the vocabulary."""
    return tp.padded_span(vocab_size) if tp.size > 1 else slice(0, vocab_size)


def _copy_rows_into(name: str, param: torch.Tensor, rows: slice) -> Loader:
    """A whole [vocab, hidden] table's `rows` into param (zeros past its end)."""
    def load(tensor: torch.Tensor | UnreadTensor) -> None:
        if tensor.shape[1:] != param.shape[1:] or rows.start >= tensor.shape[0]:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, which rows {rows.start}.. of "
                             f"{tuple(param.shape)} do not fit")
        held = tensor[rows.start : min(rows.stop, tensor.shape[0])]
        param.data[: held.shape[0]].copy_(held)
        param.data[held.shape[0]:].zero_()

    return load


def _copy_into(name: str, param: torch.Tensor) -> Loader:
    def load(tensor: torch.Tensor | UnreadTensor) -> None:
        tensor = read_whole(tensor)
        if param.shape != tensor.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor)

    return load
