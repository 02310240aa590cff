"""LoRA adapters, in layers as vLLM's `vllm/lora` has them:

    disk (a PEFT directory; remote_source: hub adapters are downloaded into the HF cache,
          S3 adapters into quiver's adapter cache)
      -> host memory   registry.AdapterRegistry + host_cache.HostAdapterCache (LRU, bounded)
      -> device slots  slots.AdapterSlots: per projection stacked A/B buffers, one row per slot
      -> per-step slot mapping (kernels.lora_meta) -> batched kernels (kernels.lora_projection)

`peft_config` reads adapter_config.json, `loader` the weights, `validation` checks both against
the base model (`spec.BaseModelSpec`); `size_limits` bounds every file before it is read. peft
itself is never imported on the serving path.
"""
