"""The plain-torch reference of a LoRA delta: the semantics every LoRA kernel must reproduce.

    for t in range(T):
        s = token_slots[t]
        if s < 0: continue                                   # base-model token: no delta
        h = lora_a[s].float() @ x[t].float()                 # shrink  [R]
        d = scaling[s] * (lora_b[s].float() @ h)             # expand  [out]
        y[t, out_slice] = (y[t, out_slice].float() + d).to(y.dtype)

One loop iteration per token and float32 throughout: slow on purpose, obviously right. BGMV
(decode) and SGMV (prefill) are two ways to run this loop fast; they differ only in how tokens
are grouped (per row vs per segment), never in the result. Ranks below R are zero rows of A and
zero columns of B, so they add exact zeros.
"""

from __future__ import annotations

import torch

from quiver_server.kernels.lora_meta import LoraBatchMeta


def add_lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    meta: LoraBatchMeta,
    out_slice: slice,
) -> None:
    for t, s in enumerate(meta.token_slots.tolist()):
        if s < 0:
            continue
        h = lora_a[s].float() @ x[t].float()
        d = scaling[s].float() * (lora_b[s].float() @ h)
        y[t, out_slice] = (y[t, out_slice].float() + d).to(y.dtype)
