"""The picture of a `make bench-peers` report: throughput and time to first token per server and
scenario (bars, best run; long prompts: the running streams' inter-token p99 and the arrivals'
TTFT p50). Needs matplotlib (pyproject's `bench` extra). Usable alone:

    python -m bench.peers.plot bench/results/peers-cpu-....json  # writes the .png beside it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _bars(axis, title: str, unit: str, values: dict[str, dict[str, float]], colors: dict[str, str]) -> None:
    """values: {scenario: {server: value}}, drawn as groups of bars per scenario, each server in
    its own colour in every panel."""
    scenarios = list(values)
    servers = sorted({s for per in values.values() for s in per})
    width = 0.8 / max(1, len(servers))
    for i, server in enumerate(servers):
        xs = [j + i * width for j, scenario in enumerate(scenarios) if server in values[scenario]]
        ys = [values[scenario][server] for scenario in scenarios if server in values[scenario]]
        bars = axis.bar(xs, ys, width, label=server, color=colors[server])
        axis.bar_label(bars, fmt="%.3g", fontsize=6)
    axis.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(scenarios))], scenarios, fontsize=8)
    axis.set_title(title, fontsize=9)
    axis.set_ylabel(unit, fontsize=8)
    # Outside the bars, right of the panel: inside, it hid the figures of some.
    axis.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput: dict[str, dict[str, float]] = {}
    ttft: dict[str, dict[str, float]] = {}
    long_itl: dict[str, dict[str, float]] = {}
    for server, block in report["servers"].items():
        for scenario, figures in block.get("scenarios", {}).items():
            if scenario == "long-prompts":
                long_itl.setdefault("running ITL p99", {})[server] = \
                    figures["running_inter_token_s_after_arrival"].get("p99", 0.0)
                long_itl.setdefault("arrival TTFT p50", {})[server] = figures["arrival_ttft_s"].get("p50", 0.0)
                continue
            throughput.setdefault(scenario, {})[server] = figures["throughput_tok_s_best"]
            ttft.setdefault(scenario, {})[server] = figures["ttft_s"]["p50"]
    panels = [(t, u, v) for t, u, v in (("throughput (best run)", "tokens/s", throughput),
                                          ("time to first token p50", "s", ttft),
                                          ("long prompts arriving", "s", long_itl)) if v]
    if not panels:
        raise ValueError("the report has no figures to plot")
    servers = sorted(report["servers"])
    # matplotlib's default colour cycle, C0..C9, one per server in every panel.
    colors = {server: f"C{i % 10}" for i, server in enumerate(servers)}
    figure, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for axis, (title, unit, values) in zip(axes[:, 0], panels, strict=True):
        _bars(axis, title, unit, values, colors)
    cpu = report.get("machine", {}).get("cpu_model", "")
    figure.suptitle(f"make bench-peers ({cpu}, {report['machine'].get('cpu_count')} cores)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    source = Path(sys.argv[1])
    plot(json.loads(source.read_text()), source.with_suffix(".png"))
    print(source.with_suffix(".png"))
