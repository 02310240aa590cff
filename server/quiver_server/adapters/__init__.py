"""LoRA adapters, in layers as vLLM's `vllm/lora` has them:

    disk (a PEFT directory; hub adapters are downloaded into the HF cache)
      -> host memory   registry.AdapterRegistry + host_cache.HostAdapterCache (LRU, bounded)
      -> device slots  slots.AdapterSlots: per projection stacked A/B buffers, one row per slot
      -> per-step slot mapping (kernels.lora_meta) -> batched kernels (kernels.LoraProjection)

`peft_config` reads adapter_config.json, `loader` the weights, `validation` checks both against
the base model (`spec.BaseModelSpec`). peft itself is never imported on the serving path.
"""
