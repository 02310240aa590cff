"""`GET /metrics` read by Prometheus's own Python parser (prometheus_client): every family is
declared with HELP and TYPE, histograms are well formed, and their counts match the requests this
test sent, per adapter, with adapter labels bounded by `--metrics-max-adapter-labels`.

One stack of its own (base + local adapters, two device slots, two adapter labels), requests sent
one at a time so that the order adapters are first seen in, and which slot each evicts, is fixed."""

from __future__ import annotations

import json
import re
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapter_models import SERVED_NAME, SHARD_ENV, adapter_set
from stack import Stack, StackConfig

SLOTS = 2
MAX_LABELS = 2
# Four adapters, two at a time in order: the last two must share the label "other".
ADAPTERS = ["kinds/rank4", "kinds/rank8", "kinds/rank16", "kinds/qv-only"]
PER_MODEL = 2
BASE_REQUESTS = 3
PROMPT = "The quick brown fox"
MAX_TOKENS = 6
# A shared CI box can take minutes to start a stack.
STARTUP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    adapters = adapter_set(tmp_path_factory)
    config = StackConfig(
        model_id=str(adapters.base_dir),
        served_model_name=SERVED_NAME,
        max_input_tokens=256,
        max_total_tokens=512,
        extra_args=["--adapter-source", "local", "--adapter-root", str(adapters.root), "--max-lora-rank", "64",
                    "--max-active-adapters", str(SLOTS), "--metrics-max-adapter-labels", str(MAX_LABELS)],
        extra_env=SHARD_ENV,
    )
    log = tmp_path_factory.mktemp("logs") / "metrics-prometheus.log"
    stack = Stack(config, log).start(timeout_s=STARTUP_TIMEOUT_S)
    yield stack
    stack.stop()


def _families(stack) -> dict[str, Any]:
    status, body = stack.get("/metrics")
    assert status == 200
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def _by_label(family, suffix: str, label: str = "adapter") -> dict[str, float]:
    """{label value: sample value} of the family's samples named `<name><suffix>`."""
    name = family.name + suffix
    return {s.labels[label]: s.value for s in family.samples if s.name == name}


@pytest.fixture(scope="module")
def sent(stack) -> dict[str, Any]:
    """Sends every request once, in order; returns what was sent, by expected adapter label."""
    completions: dict[str, list[int]] = defaultdict(list)  # label -> completion_tokens each
    prompts: dict[str, list[int]] = defaultdict(list)
    order: list[str | None] = [None] * BASE_REQUESTS + [a for a in ADAPTERS for _ in range(PER_MODEL)]
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        for model in order:
            response = client.completions.create(model=model or SERVED_NAME, prompt=PROMPT,
                                                 max_tokens=MAX_TOKENS, temperature=0)
            label, usage = _expected_label(model), response.usage
            assert usage is not None
            completions[label].append(usage.completion_tokens)
            prompts[label].append(usage.prompt_tokens)
        # One refused request (an unknown parameter value), and one path that matches no route.
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=-1)
    status, _ = stack.get("/no/such/route")
    assert status == 404
    return {"completions": completions, "prompts": prompts, "refused": refused.value, "order": order}


def _expected_label(model: str | None) -> str:
    if model is None:
        return SERVED_NAME
    return model if ADAPTERS.index(model) < MAX_LABELS else "other"


def test_every_family_is_declared_and_histograms_are_well_formed(stack, sent):
    families = _families(stack)
    for family in families.values():
        assert family.documentation, f"{family.name} has no HELP"
        assert family.type in {"counter", "gauge", "histogram", "summary"}, family.name
        if family.type != "histogram":
            continue
        series: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        counts: dict[tuple, float] = {}
        for sample in family.samples:
            key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            if sample.name.endswith("_bucket"):
                series[key].append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_count"):
                counts[key] = sample.value
        for key, buckets in series.items():
            values = [value for _, value in sorted(buckets)]
            assert values == sorted(values), f"{family.name}{key}: buckets not cumulative"
            assert sorted(buckets)[-1][0] == float("inf"), f"{family.name}{key}: no +Inf bucket"
            assert values[-1] == counts[key], f"{family.name}{key}: +Inf bucket != count"
    # Base units: seconds and tokens, counters end in _total.
    for name, family in families.items():
        if family.type == "counter":
            assert any(s.name == name + "_total" for s in family.samples), name


def test_request_histograms_count_the_requests_sent_per_adapter(stack, sent):
    families = _families(stack)
    completions, prompts = sent["completions"], sent["prompts"]
    expected_counts = {label: len(tokens) for label, tokens in completions.items()}
    assert expected_counts == {SERVED_NAME: BASE_REQUESTS, ADAPTERS[0]: PER_MODEL, ADAPTERS[1]: PER_MODEL,
                               "other": PER_MODEL * (len(ADAPTERS) - MAX_LABELS)}
    for name in ("quiver_request_time_to_first_token_seconds", "quiver_request_duration_seconds",
                 "quiver_request_queue_seconds", "quiver_request_prompt_tokens",
                 "quiver_request_generation_tokens"):
        assert _by_label(families[name], "_count") == expected_counts, name
    generated = _by_label(families["quiver_request_generation_tokens"], "_sum")
    assert generated == {label: sum(tokens) for label, tokens in completions.items()}
    prompt_sum = _by_label(families["quiver_request_prompt_tokens"], "_sum")
    assert prompt_sum == {label: sum(tokens) for label, tokens in prompts.items()}
    # Every token after a request's first is one inter-token gap.
    gaps = _by_label(families["quiver_request_inter_token_latency_seconds"], "_count")
    assert gaps == {label: sum(t - 1 for t in tokens) for label, tokens in completions.items()}


def test_adapter_labels_are_bounded(stack, sent):
    allowed = {SERVED_NAME, *ADAPTERS[:MAX_LABELS], "other"}
    for family in _families(stack).values():
        for sample in family.samples:
            if "adapter" in sample.labels:
                assert sample.labels["adapter"] in allowed, (family.name, sample.labels)


def test_http_responses_are_counted_by_endpoint_status_and_code(stack, sent):
    family = _families(stack)["quiver_http_requests"]
    counts: dict[tuple[str, str, str], float] = {}
    for sample in family.samples:
        if sample.name == "quiver_http_requests_total":
            counts[(sample.labels["endpoint"], sample.labels["status"], sample.labels["code"])] = sample.value
    assert counts.get(("/v1/completions", "200", "none")) == len(sent["order"])
    refused = sent["refused"]
    assert counts.get(("/v1/completions", str(refused.status_code), refused.code)) == 1
    assert counts.get(("unmatched", "404", "not_found")) == 1


def test_batches_and_adapter_slots(stack, sent):
    families = _families(stack)
    batch = families["quiver_batch_size"]
    prefill = {s.name: s.value for s in batch.samples if s.labels.get("step") == "prefill"}
    # Nothing was preempted, so each request was prefilled exactly once.
    assert prefill["quiver_batch_size_sum"] == len(sent["order"])
    # Sequential requests to four adapters through two slots: each activated once; the third and
    # fourth evicted the first and second (the least recently used).
    activations = _by_label(families["quiver_adapter_activations"], "_total")
    assert activations == {ADAPTERS[0]: 1, ADAPTERS[1]: 1, "other": 2}
    evictions = _by_label(families["quiver_adapter_evictions"], "_total")
    assert evictions == {ADAPTERS[0]: 1, ADAPTERS[1]: 1}
    # The shard's host cache (64 adapters by default) kept all four: every activation a hit.
    single = {name: family.samples[0].value for name, family in families.items() if len(family.samples) == 1}
    assert single["quiver_adapter_host_cache_hits"] == len(ADAPTERS)
    assert single["quiver_adapter_host_cache_misses"] == 0
    # Each adapter was loaded into host memory once, by its first request.
    loads = {s.name: s.value for s in families["quiver_adapter_load_seconds"].samples}
    assert loads["quiver_adapter_load_seconds_count"] == len(ADAPTERS)


def test_gie_gauges_agree_with_info(stack, sent):
    families = _families(stack)
    with urllib.request.urlopen(stack.base_url + "/info", timeout=10) as response:
        limits = json.load(response)["limits"]
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels == {"block_size": str(limits["block_size"]), "num_gpu_blocks": str(limits["num_blocks"])}
    gauge = {name: family.samples[0].value for name, family in families.items() if name.startswith("vllm:num_")}
    assert gauge == {"vllm:num_requests_waiting": 0, "vllm:num_requests_running": 0}
    assert families["vllm:kv_cache_usage_perc"].samples[0].value == 0
    lora = families["vllm:lora_requests_info"].samples[0]
    # The last two adapters hold the two slots; nothing waits.
    assert lora.labels == {"max_lora": str(SLOTS), "running_lora_adapters": ",".join(sorted(ADAPTERS[2:])),
                           "waiting_lora_adapters": ""}
    assert lora.value > 1.7e9  # a Unix timestamp


REPO = Path(__file__).resolve().parent.parent
# A metric name in a PromQL expression or in the docs' tables.
METRIC_NAME = re.compile(r"\b(?:quiver_|vllm:)[a-z_]+")


def _series_names(families: dict[str, Any]) -> set[str]:
    """Every sample name /metrics serves (`_total`, `_bucket`, `_sum`, `_count` included)."""
    return {sample.name for family in families.values() for sample in family.samples}


def test_the_observability_page_lists_every_family(stack, sent):
    page = (REPO / "docs" / "observability.md").read_text()
    documented = set(METRIC_NAME.findall(page))
    for name, family in _families(stack).items():
        exposed = name + "_total" if family.type == "counter" else name
        assert exposed in documented, f"{exposed} is not in docs/observability.md"


def test_the_grafana_dashboard_queries_only_served_series(stack, sent):
    dashboard = json.loads((REPO / "docs" / "grafana" / "quiver.json").read_text())
    served = _series_names(_families(stack))
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in METRIC_NAME.findall(target["expr"])
    }
    assert queried, "the dashboard queries nothing"
    assert queried <= served, f"not served: {sorted(queried - served)}"
