"""The shard's step machinery: plan a step from its requests once, then run model -> sample -> record.

- `engine`: `Engine`, the model, the KV cache and the running batches; prefill, decode, embed;
- `request_checks`: what a step refuses, and each request's adapter slot, looked up once;
- `step_plan`: a step's plan (request states, tokens, forward batch, spans, sampling inputs);
- `batch_state`: the running requests between steps, and the tensors cached per batch;
- `warmup`: the dry run, the KV cache's sizing and the decode graphs' capture;
- `forward_batch`, `kv_cache`, `kv_cache_dtype`, `decode_graphs`: what a forward pass reads;
- `sampling`, `penalties`, `logprobs`, `draw_streams`: from logits to tokens;
- `pooling`: embeddings; `batch_types`: the plain data the service and the engine exchange;
- `engine_thread`: the one thread that runs the engine's calls.

Nothing is imported here, so the plain-data modules load without torch's model code.
"""
