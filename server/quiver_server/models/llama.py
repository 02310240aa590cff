"""The Llama family — Llama, Mistral, Qwen2 — on the paged KV cache.

One decoder shape covers all three; what differs is read from config.json in
`LlamaConfig.from_hf`: Qwen2 has q/k/v biases, Mistral (and Qwen2 when enabled) a sliding
attention window, Llama optional attention/MLP biases and RoPE scaling.

Module and parameter names mirror transformers' (model.layers.N.self_attn...), except that
q/k/v and gate/up are fused into one `Linear` each (`LAYOUT`); `load_weights` maps checkpoint
names onto the fused parts. The ops (C++ kernels on CPU, torch elsewhere) are the shard's
`KernelOps`, chosen once at load and handed to every layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from quiver_server.forward_batch import ForwardBatch
from quiver_server.kernels import cpu_gemm
from quiver_server.kernels.ops import KernelOps
from quiver_server.kv_cache import PagedKVCache
from quiver_server.layers.attention import prefill_attention, write_kv
from quiver_server.layers.linear import Linear
from quiver_server.layers.norm import RMSNorm
from quiver_server.layers.rotary import RopeConfig, RotaryEmbedding
from quiver_server.models.family import FusedProjection, ProjectionLayout
from quiver_server.weights import iter_tensors

MODEL_TYPES = ("llama", "mistral", "qwen2")

# The projections, fused per Linear; LoRA may target every one of them. PEFT could also target
# the embeddings and the output head, which we do not serve LoRA on.
LAYOUT = ProjectionLayout(
    layers="model.layers",
    fused=(
        FusedProjection("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
        FusedProjection("self_attn", "o_proj", ("o_proj",)),
        FusedProjection("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
        FusedProjection("mlp", "down_proj", ("down_proj",)),
    ),
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    non_lora_modules=("model.embed_tokens", "lm_head"),
)
FUSED_INTO = LAYOUT.fused_into


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full causal attention

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlamaConfig:
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not in the Llama family {MODEL_TYPES}")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (the Llama family uses silu)")
        num_layers = int(config["num_hidden_layers"])
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
        windows: list[int | None] = [None] * num_layers
        if model_type == "qwen2":
            # Qwen2 always has q/k/v biases and never an o_proj bias.
            qkv_bias, o_bias = True, False
            if config.get("use_sliding_window", False) and config.get("sliding_window") is not None:
                layer_types = config.get("layer_types") or [
                    "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
                    for i in range(num_layers)
                ]
                windows = [int(config["sliding_window"]) if t == "sliding_attention" else None for t in layer_types]
        elif model_type == "mistral" and config.get("sliding_window") is not None:
            windows = [int(config["sliding_window"])] * num_layers
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope=RopeConfig.from_hf(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            sliding_windows=tuple(windows),
        )


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_index: int, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_windows[layer_index]
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width}, bias=cfg.qkv_bias, ops=ops
        )
        self.o_proj = Linear(q_width, {"o_proj": cfg.hidden_size}, bias=cfg.o_bias, ops=ops)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rows: if given, only these tokens' outputs are computed past attention (their K/V
        are still written for every token)."""
        tokens = x.shape[0]
        q, k, v = self.store_kv(x, cos, sin, batch, k_cache, v_cache)
        if batch.is_prefill:
            # Every token's K/V of this layer is in the cache before any sequence reads it back.
            out = prefill_attention(q, k, v, batch, self.scale, self.sliding_window, k_cache, v_cache)
        else:
            out = self.ops.decode_attention(q, k_cache, v_cache, batch, self.scale, self.sliding_window)
        out = out.reshape(tokens, self.num_heads * self.head_dim)
        if rows is None:
            return self.o_proj(out, batch)
        return self.o_proj(out[rows], batch.at_logits_rows())

    def store_kv(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projects x to q, k, v (rotated), writes k and v into the cache, returns all three."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x, batch).view(x.shape[0], heads + 2 * kv_heads, self.head_dim)
        # q and k heads sit side by side, so one rotary application covers both.
        qk = self.ops.rotary(qkv[:, : heads + kv_heads], cos, sin)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        width = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size, {"gate_proj": width, "up_proj": width}, bias=cfg.mlp_bias, ops=ops
        )
        self.down_proj = Linear(width, {"down_proj": cfg.hidden_size}, bias=cfg.mlp_bias, ops=ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x, batch)), batch)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_index: int, ops: KernelOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, layer_index, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, batch, k_cache, v_cache, rows)
        if rows is not None:
            x, batch = x[rows], batch.at_logits_rows()
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x), batch)

    def store_kv(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """Only what later passes need of this layer: the K/V of x's tokens, into the cache."""
        self.self_attn.store_kv(self.input_layernorm(x), cos, sin, batch, k_cache, v_cache)


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig, ops: KernelOps) -> None:
        super().__init__()
        # Storage given up front: the loader fills it, and initialising it on the meta device
        # would import torch._dynamo (seconds of every shard start) for nothing.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    layout: ClassVar[ProjectionLayout] = LAYOUT

    def __init__(self, cfg: LlamaConfig, ops: KernelOps) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.model = Backbone(cfg, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None  # built on the target device by `load`
        self.lm_head_packed: cpu_gemm.PackedWeight | None = None  # CPU: the LM head prepacked, see `load`

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """input_ids [T] (flattened batch) -> logits [len(batch.logits_indices), vocab]
        (decode: logits_indices is every row). A prefill without logits rows (every sequence a
        chunk of an unfinished prompt) only writes the K/V: the last layer stops there and the
        LM head does not run."""
        assert self.rotary is not None, "use LlamaForCausalLM.load"
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        last = len(self.model.layers) - 1
        if batch.is_prefill and batch.logits_indices.shape[0] == 0:
            for index, layer in enumerate(self.model.layers[:last]):
                x = layer(x, cos, sin, batch, kv_cache.k[index], kv_cache.v[index])
            final = self.model.layers[last]
            assert isinstance(final, DecoderLayer)
            final.store_kv(x, cos, sin, batch, kv_cache.k[last], kv_cache.v[last])
            return x.new_empty(0, self.config.vocab_size)
        for index, layer in enumerate(self.model.layers):
            # Past the last layer's attention only the rows whose logits are wanted matter:
            # in a prefill that skips the o_proj and MLP of every other prompt token.
            rows = batch.logits_indices if index == last and batch.is_prefill else None
            x = layer(x, cos, sin, batch, kv_cache.k[index], kv_cache.v[index], rows)
        x = self.model.norm(x)  # decode: every row is wanted
        if self.lm_head_packed is not None:
            return cpu_gemm.linear(x, self.lm_head_packed, None)
        return self.lm_head(x)

    @classmethod
    def load(cls, model_dir: Path, config: dict[str, Any], dtype: torch.dtype, ops: KernelOps) -> LlamaForCausalLM:
        cfg = LlamaConfig.from_hf(config)
        device = ops.device
        with torch.device("meta"):
            model = cls(cfg, ops)
        # Allocate uninitialised storage directly in the target dtype; the checkpoint fills it.
        model = model.to(dtype).to_empty(device=device)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, device)
        model.load_weights(iter_tensors(model_dir, device))
        model.pack_weights()
        return model.eval()

    def pack_weights(self) -> None:
        """Every projection and the LM head on prepacked weights where the ops pack them (float32
        on CPU, `kernels.cpu_gemm`). A tied LM head packs a copy: the embedding lookup still
        needs the plain table."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_weight()
        self.lm_head_packed = self.ops.pack(self.lm_head.weight)
        if self.lm_head_packed is not None and not self.config.tie_word_embeddings:
            self.lm_head.register_parameter("weight", None)

    def checkpoint_names(self) -> set[str]:
        """The tensor names a transformers checkpoint of this config must contain."""
        names: set[str] = set()
        for module_name, module in self.named_modules():
            if isinstance(module, Linear):
                parent = module_name.rpartition(".")[0]
                kinds = ("weight", "bias") if module.bias is not None else ("weight",)
                names.update(f"{parent}.{part}.{kind}" for part in module.parts for kind in kinds)
            else:
                names.update(f"{module_name}.{name}" for name, _ in module.named_parameters(recurse=False))
        if self.config.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        expected = self.checkpoint_names()
        loaded: set[str] = set()
        for name, tensor in tensors:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints store the (recomputed) RoPE buffer
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still carry a copy
            if name not in expected:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint for {self.config.model_type}")
            module_path, _, kind = name.rpartition(".")
            parent, _, projection = module_path.rpartition(".")
            if projection in FUSED_INTO:
                linear = self.get_submodule(f"{parent}.{FUSED_INTO[projection]}")
                assert isinstance(linear, Linear)
                linear.load_part(projection, kind, tensor)
            else:
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
