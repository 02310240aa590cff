"""quiver shard: model weights, paged KV cache, batched prefill/decode over gRPC."""
