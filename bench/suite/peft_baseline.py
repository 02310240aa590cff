"""Baseline: the naive way to serve many adapters — `transformers` + `peft`, one request at a
time, switching adapters with `set_adapter`.

Every adapter is loaded once into one PeftModel under its id (`load_adapter`), in the serving
dtype (no float32 upcast of the adapter weights, so both sides compute LoRA in the same dtype).
Each request then runs alone: `set_adapter(id)` and a greedy `generate` of exactly
max_new_tokens (min_new_tokens = max_new_tokens, as quiver's ignore_eos). Throughput is total
generated tokens / total wall time over the requests, the best of `repeats` passes.

A server of this kind runs one request at a time, so its throughput does not depend on how many
requests there are: timing the first `limit` requests of a scenario (in the scenario's own
request order, so they switch adapters exactly as the scenario does) measures the same rate as
timing all of them, in a fraction of the time on a CPU.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.fixtures import adapters, bench_model
from bench.suite import hf_baseline


class PeftServer:
    """The base model with every benchmark adapter loaded, ready to serve one request at a time."""

    def __init__(self, model_dir: Path, adapter_root: Path, adapter_ids: list[str], device: str, dtype: str):
        import peft

        self.device = device
        base = hf_baseline.load(str(model_dir), device, dtype)
        first, *rest = adapter_ids
        self.model = peft.PeftModel.from_pretrained(base, adapter_root / first, adapter_name=first,
                                                    autocast_adapter_dtype=False)
        for name in rest:
            self.model.load_adapter(adapter_root / name, adapter_name=name, autocast_adapter_dtype=False)
        self.model.eval()
        for name in adapter_ids:
            adapters.check_loaded(self.model, name)

    def generate(self, adapter_id: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        """One request: switch to its adapter, generate; returns the new token ids."""
        self.model.set_adapter(adapter_id)
        return hf_baseline.greedy(self.model, self.device, prompt, max_new_tokens)

    def measure(self, requests: list[tuple[str, list[int]]], max_new_tokens: int, repeats: int,
                total_requests: int) -> tuple[dict, list[list[int]]]:
        """Serves `requests` ((adapter id, prompt) in order) one at a time, `repeats` passes;
        reports the fastest pass (`total_requests` is the scenario's size, for the report) and
        the generated ids per request (greedy: the same in every pass)."""
        self.generate(requests[0][0], requests[0][1], 2)  # warm-up: first-call paths
        passes = []
        for _ in range(repeats):
            tokens, per_request, outputs = 0, [], []
            hf_baseline.sync(self.device)
            started = time.perf_counter()
            for adapter_id, prompt in requests:
                request_started = time.perf_counter()
                outputs.append(self.generate(adapter_id, prompt, max_new_tokens))
                tokens += len(outputs[-1])
                hf_baseline.sync(self.device)
                per_request.append(time.perf_counter() - request_started)
            passes.append((time.perf_counter() - started, tokens, per_request))
        wall, tokens, per_request = min(passes, key=lambda p: p[0])
        return {
            "requests_timed": len(requests),
            "requests_in_scenario": total_requests,
            "subset": len(requests) < total_requests,
            "adapters_switched_between": len({adapter for adapter, _ in requests}),
            "generated_tokens": tokens,
            "wall_s": round(wall, 3),
            "wall_s_all_runs": [round(p[0], 3) for p in passes],
            "request_wall_s_max": round(max(per_request), 4),
            "throughput_tok_s": round(tokens / wall, 2),
        }, outputs


def agreement(quiver_texts: dict[int, str], peft_outputs: list[list[int]]) -> dict:
    """How many of the timed requests quiver answered with exactly peft's greedy tokens: proof
    that the measured path applied the adapters. Quiver's text is compared word by word with
    peft's ids in the bench tokenizer's words (w<id>; special tokens are not shown in text).
    Expect all on float32 CPU; in bfloat16 batched and one-at-a-time arithmetic differ, and a
    random model's near-tied logits then let greedy paths part after a few tokens."""
    identical, first_equal = 0, 0
    for index, tokens in enumerate(peft_outputs):
        want = [f"w{t}" for t in tokens if t >= len(bench_model.SPECIAL)]
        got = quiver_texts.get(index, "").split()
        identical += got == want
        first_equal += bool(got and want and got[0] == want[0])
    return {"requests": len(peft_outputs), "identical": identical, "first_token_equal": first_equal}
