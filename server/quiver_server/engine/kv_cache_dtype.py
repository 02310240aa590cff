"""The KV cache's storage dtype (`--kv-cache-dtype`) and the one conversion into it.

- `auto`: the model's dtype (the default; float32 stays the exactness reference).
- `bfloat16`: half the bytes of a float32 model's cache, 8 bits of precision per element.
- `fp8` (= `fp8_e4m3`): float8 e4m3fn, a quarter of float32's bytes and half of bfloat16's,
  3 mantissa bits, largest finite value 448. `fp8_e5m2`: 2 mantissa bits, range to 57344.

Elements are stored unscaled (vLLM's default where a checkpoint brings no KV scales): each value
rounded to nearest, clamped to the format's largest finite value first, since torch's and
Triton's float8 conversions make an overflow NaN or infinity. Every attention path reads what the
cache holds, the newest tokens of a prefill included, so a lossy cache gives the same numbers
chunked or not, cached prefix or not; the reference is transformers with its cache's K/V rounded
the same way (`server/tests/test_kv_cache_dtype.py`). Each kernel widens the stored elements to
the model's dtype or float32 as it reads them, exactly: every float8 and bfloat16 value is a
float16 (float8), bfloat16 and float32 value.
"""

from __future__ import annotations

import torch

CHOICES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
_NAMED = {
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# The dtypes a cache may have besides its model's own (the kernels take exactly these).
NARROW_DTYPES = frozenset(_NAMED.values())
FLOAT8_DTYPES = frozenset((torch.float8_e4m3fn, torch.float8_e5m2))
# float8 conversions need sm_89 (Ada) or later in Triton's compiled kernels.
FLOAT8_MIN_CAPABILITY = (8, 9)


def resolve(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache dtype `name` means for a model in `model_dtype` on `device`; ValueError for an
    unknown name or one the device cannot store."""
    if name not in CHOICES:
        raise ValueError(f"unknown --kv-cache-dtype {name!r}, expected one of {', '.join(CHOICES)}")
    if name == "auto":
        return model_dtype
    dtype = _NAMED[name]
    if dtype in FLOAT8_DTYPES and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FLOAT8_MIN_CAPABILITY:
            raise ValueError(f"--kv-cache-dtype {name} needs a GPU of compute capability 8.9 or later "
                             f"(this one is {capability[0]}.{capability[1]})")
    if model_dtype == torch.float64:
        raise ValueError(f"--kv-cache-dtype {name} is for 32- and 16-bit models; this one is float64")
    return dtype


def cache_fits(q_dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether attention kernels take caches k_cache/v_cache under queries in q_dtype."""
    return k_cache.dtype == v_cache.dtype and (k_cache.dtype == q_dtype or k_cache.dtype in NARROW_DTYPES)


def float8_limit(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 dtype, 0 for any other (no clamp)."""
    return float(torch.finfo(dtype).max) if dtype in FLOAT8_DTYPES else 0.0


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to the cache's dtype as every writer stores it (float8: clamped first)."""
    if x.dtype == dtype:
        return x
    limit = float8_limit(dtype)
    if limit:
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache in `dtype` gives it back, in x's own dtype."""
    return x if x.dtype == dtype else to_cache(x, dtype).to(x.dtype)
