"""`make bench-peers`: quiver, vLLM's CPU build and llama.cpp's llama-server side by side on the
same model (the bench's 58M Llama, float32), the same LoRA adapters and the same workloads,
driven by quiver's own load generator (bench/fixtures/load.py). Peers are installed on first use
(install.py); a peer that cannot be installed or started is reported with the reason and
the others still run.

Two phases, each with its servers running side by side and every repeat alternating between
them (a shared machine drifts over minutes; alternating puts every server in the same periods):

- A, prefix caching off everywhere (the bench repeats its prompts): base model and `--adapters`
  adapters, `--concurrency` streams, `--prompt-tokens` prompts, `--max-tokens` greedy tokens with
  ignore_eos. Servers: quiver; vLLM with LoRA (eager); vLLM without LoRA (torch.compile, its
  best base configuration); llama-server with the adapters.
- B, prefix caching on: the shared-prefix and long-prompts-arriving workloads
  (bench/fixtures/cache_scenarios.py) on quiver, vLLM (no LoRA, compiled) and llama-server.
- R, the real model (`real`, real.py): the demo model and its adapter on every server, in
  float32 and in the formats people run on CPUs, with greedy agreement against transformers.

Prints ONE JSON report (report.py) on stdout, writes it and its plot (plot.py) to
bench/results/; progress goes to stderr. docs/benchmarks-peers.md documents every peer flag.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.fixtures import adapters, bench_model, cache_scenarios, load
from bench.fixtures.paths import REPO_ROOT, RESULTS_DIR
from bench.fixtures.stack import LAUNCHER, Stack, StackConfig
from bench.peers import gguf_convert
from bench.peers import install as peer_install
from bench.peers import plot as peers_plot
from bench.peers import real as peers_real
from bench.peers import report as peers_report
from bench.peers import servers as peer_servers
from bench.peers.servers import Limits, PeerServer, PeerUnavailable

SERVED_NAME = "bench"
SCENARIOS = ("base", "adapters", "shared-prefix", "long-prompts", "real")


def log(message: str) -> None:
    print(f"[bench-peers] {message}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one repeat, one request per stream, 16 tokens, 4 adapters, short long-run")
    p.add_argument("--servers", default="quiver,vllm,llama.cpp", help="comma-separated: quiver,vllm,llama.cpp")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated of {', '.join(SCENARIOS)}")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--adapters", type=int, default=32, help="distinct adapters of the adapters scenario")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="runs per server and scenario, alternating servers")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="shared system prefix of the shared-prefix scenario")
    p.add_argument("--suffix-tokens", type=int, default=64, help="distinct suffix of each shared-prefix prompt")
    p.add_argument("--long-running", type=int, default=28, help="streams decoding when the long prompts arrive")
    p.add_argument("--long-running-tokens", type=int, default=256, help="max_tokens of those streams")
    p.add_argument("--long-arrivals", type=int, default=4)
    p.add_argument("--long-prompt-tokens", type=int, default=2048)
    p.add_argument("--vllm-batched-tokens", type=int, default=8192,
                   help="vLLM's --max-num-batched-tokens in the real-model phase (docs/benchmarks-peers.md)")
    p.add_argument("--real-only", default="",
                   help="comma-separated server labels: the real-model phase runs only these (default: all)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument("--model-root", type=Path, default=REPO_ROOT / ".cache" / "bench-models")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args()
    if args.quick:
        args.repeats = 1
        args.requests_per_client = 1
        args.max_tokens = min(args.max_tokens, 16)
        args.adapters = min(args.adapters, 4)
        args.long_running_tokens = min(args.long_running_tokens, 64)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}")
    return args


def quiver_has_flag(flag: str) -> bool:
    """Whether this build's launcher knows `flag` (issue 16's cache flags landed with it)."""
    done = subprocess.run([str(LAUNCHER), "--help"], capture_output=True, text=True)
    return flag in done.stdout


class QuiverServer:
    """quiver through stack.py, shaped like a PeerServer for the phase loop."""

    def __init__(self, label: str, config: StackConfig, logs: Path, flags_note: str):
        self.label = label
        self.stack = Stack(config, logs / f"{label}.log")
        self.model_bodies: dict[str, dict] = {}
        self.extra_body: dict = {}
        self.flags_note = flags_note

    @property
    def base_url(self) -> str:
        return self.stack.base_url

    def start(self, timeout_s: float) -> None:
        try:
            self.stack.start(timeout_s=timeout_s)
        except Exception as err:
            raise PeerUnavailable(f"{self.label} did not start: {str(err)[-1200:]}") from err

    def stop(self) -> None:
        self.stack.stop()


@dataclass
class Entry:
    """One server of a phase and the scenarios it runs there."""

    server: PeerServer | QuiverServer
    scenarios: list[str]
    runs: dict[str, list] = field(default_factory=dict)  # scenario: [(figures, texts) per repeat]
    error: str | None = None
    startup_s: float | None = None  # launch to the first /health 200
    # Greedy answers against transformers' (the real-model phase), taken before the server stops.
    agreement: dict | None = None


@dataclass
class Setup:
    model_dir: Path
    adapter_root: Path
    adapter_ids: list[str]
    vocab_size: int
    logs: Path
    quiver_cache_flags: bool
    vllm_venv: Path | None = None
    llama_dir: Path | None = None
    gguf: Path | None = None
    gguf_loras: dict[str, Path] = field(default_factory=dict)
    convert_py: Path | None = None
    unavailable: dict[str, str] = field(default_factory=dict)  # server family: reason
    install_s: dict[str, float | None] = field(default_factory=dict)


def install_peers(args, setup: Setup) -> None:
    if "vllm" in args.servers:
        try:
            setup.vllm_venv, setup.install_s["vllm"] = peer_install.ensure_vllm()
        except PeerUnavailable as err:
            setup.unavailable["vllm"] = str(err)
    if "llama.cpp" in args.servers:
        try:
            setup.llama_dir, setup.install_s["llama.cpp"] = peer_install.ensure_llama_server()
            convert_py = setup.convert_py = peer_install.ensure_converter_packages()
            log("converting the model and adapters to GGUF (llama.cpp's converters, once)")
            setup.gguf, setup.gguf_loras = gguf_convert.convert(
                setup.model_dir, setup.adapter_root, setup.adapter_ids, setup.llama_dir, convert_py,
                REPO_ROOT / ".cache" / "peers" / "gguf" / setup.model_dir.name)
        except (PeerUnavailable, RuntimeError, OSError) as err:
            setup.unavailable["llama.cpp"] = str(err)


def phase_a_servers(args, setup: Setup) -> list[Entry]:
    """Prefix caching off: base model and adapters."""
    want = [s for s in ("base", "adapters") if s in args.scenarios]
    if not want:
        return []
    limits = Limits(max_model_len=args.prompt_tokens + args.max_tokens + 16, max_seqs=args.concurrency,
                    kv_tokens=args.concurrency * (args.prompt_tokens + args.max_tokens + 16))
    lora_paths = {a: setup.adapter_root / a for a in setup.adapter_ids}
    entries = []
    if "quiver" in args.servers:
        cache_flags = ["--prefix-caching", "false"] if setup.quiver_cache_flags else []
        config = StackConfig(
            model_id=str(setup.model_dir), served_model_name=SERVED_NAME, dtype="float32", device="cpu",
            cpu_kv_cache_gib=1.0, max_total_tokens=limits.max_model_len, max_input_tokens=args.prompt_tokens + 8,
            max_batch_size=args.concurrency,
            extra_args=adapters.server_flags(setup.adapter_root, len(setup.adapter_ids)) + cache_flags)
        entries.append(Entry(QuiverServer("quiver", config, setup.logs, " ".join(config.args(0)[4:])), want))
    if "vllm" in args.servers and setup.vllm_venv is not None:
        if "adapters" in want:
            entries.append(Entry(peer_servers.vllm(
                setup.vllm_venv, setup.model_dir, SERVED_NAME, setup.logs, limits, prefix_caching=False,
                lora_paths=lora_paths, eager=True, kv_gib=1, label="vllm-lora-eager"), want))
        if "base" in want:
            entries.append(Entry(peer_servers.vllm(
                setup.vllm_venv, setup.model_dir, SERVED_NAME, setup.logs, limits, prefix_caching=False,
                lora_paths=None, eager=False, kv_gib=1, label="vllm-compiled"), ["base"]))
    if "llama.cpp" in args.servers and setup.gguf is not None and setup.llama_dir is not None:
        entries.append(Entry(peer_servers.llama_server(
            setup.llama_dir / "llama-server", setup.gguf, SERVED_NAME, setup.gguf_loras, setup.logs, limits, threads=2,
            prefix_caching=False, label="llama.cpp"), want))
    return entries


def phase_b_servers(args, setup: Setup, shared: cache_scenarios.SharedPrefix,
                    arrivals: cache_scenarios.LongArrivals) -> list[Entry]:
    """Prefix caching on: the shared-prefix and long-prompt workloads, base model."""
    want = [s for s in ("shared-prefix", "long-prompts") if s in args.scenarios]
    if not want:
        return []
    longest = max(shared.prefix_tokens + shared.suffix_tokens + shared.max_tokens, arrivals.max_total_tokens) + 16
    kv_tokens = max(shared.concurrency * (shared.prefix_tokens + shared.suffix_tokens + shared.max_tokens),
                    arrivals.running * (arrivals.running_prompt_tokens + arrivals.running_max_tokens)
                    + arrivals.arrivals * arrivals.max_total_tokens) + 1024
    limits = Limits(max_model_len=longest, max_seqs=max(shared.concurrency, arrivals.running + arrivals.arrivals),
                    kv_tokens=kv_tokens)
    entries = []
    if "quiver" in args.servers:
        cache_flags = ["--prefix-caching", "true"] if setup.quiver_cache_flags else []
        config = StackConfig(
            model_id=str(setup.model_dir), served_model_name=SERVED_NAME, dtype="float32", device="cpu",
            cpu_kv_cache_gib=2.0, max_total_tokens=longest,
            max_input_tokens=max(shared.prefix_tokens + shared.suffix_tokens, arrivals.arrival_prompt_tokens) + 8,
            max_batch_size=limits.max_seqs, extra_args=cache_flags)
        entries.append(Entry(QuiverServer("quiver-prefix-cache", config, setup.logs, " ".join(config.args(0)[4:])),
                             want))
    if "vllm" in args.servers and setup.vllm_venv is not None:
        entries.append(Entry(peer_servers.vllm(
            setup.vllm_venv, setup.model_dir, SERVED_NAME, setup.logs, limits, prefix_caching=True,
            lora_paths=None, eager=False, kv_gib=2, label="vllm-compiled-prefix-cache"), want))
    if "llama.cpp" in args.servers and setup.gguf is not None and setup.llama_dir is not None:
        entries.append(Entry(peer_servers.llama_server(
            setup.llama_dir / "llama-server", setup.gguf, SERVED_NAME, {}, setup.logs, limits, threads=2,
            prefix_caching=True, label="llama.cpp-prefix-cache"), want))
    return entries


def warm_adapters(setup: Setup, entry: Entry, prompts: list[list[int]]) -> None:
    """One untimed request per adapter (2 tokens) before the repeats. A server that loads an
    adapter on its first request (quiver does) would otherwise pay the loads in its first repeat
    alone, which then measures loading as much as serving."""
    server = entry.server
    workload = load.Workload(SERVED_NAME, prompts, 2, 1, tuple(setup.adapter_ids),
                             extra_body=server.extra_body, model_bodies=server.model_bodies)
    log(f"{server.label}: one untimed request per adapter")
    try:
        load.measure(server.base_url + "/v1", workload, len(setup.adapter_ids), 1)
    except Exception as err:  # noqa: BLE001 - reported, not hidden
        entry.error = f"adapters warm-up: {type(err).__name__}: {err}"
        log(f"{server.label} FAILED: {entry.error[:300]}")


def run_one(args, setup: Setup, entry: Entry, scenario: str, repeat: int, prompts: list[list[int]],
            shared: cache_scenarios.SharedPrefix, arrivals: cache_scenarios.LongArrivals) -> tuple[dict, dict]:
    server = entry.server
    url = server.base_url + "/v1"
    if scenario in ("base", "adapters"):
        ids = tuple(setup.adapter_ids) if scenario == "adapters" else ()
        workload = load.Workload(SERVED_NAME, prompts, args.max_tokens, args.requests_per_client, ids,
                                 extra_body=server.extra_body, model_bodies=server.model_bodies)
        return load.measure(url, workload, args.concurrency, 1)
    if scenario in peers_real.SCENARIOS:
        return peers_real.measure(args, server, scenario, prompts)
    if scenario == "shared-prefix":
        return cache_scenarios.measure_shared_prefix(url, shared, SERVED_NAME, setup.vocab_size, repeat,
                                                     server.extra_body)
    return cache_scenarios.measure_long_arrivals(url, arrivals, SERVED_NAME, setup.vocab_size, repeat,
                                                 server.extra_body)


def run_phase(args, setup: Setup, entries: list[Entry], prompts, shared, arrivals,
              real: peers_real.RealSetup | None = None) -> list[Entry]:
    """Starts the phase's servers, runs the repeats alternating between them, stops them all
    (the real-model phase's servers after their greedy answers are compared with transformers')."""
    try:
        for entry in entries:
            log(f"starting {entry.server.label}")
            started = time.monotonic()
            try:
                entry.server.start(args.startup_timeout)
                entry.startup_s = round(time.monotonic() - started, 2)
                log(f"{entry.server.label} up in {entry.startup_s:.0f} s")
            except PeerUnavailable as err:
                entry.error = str(err)
                log(f"{entry.server.label} UNAVAILABLE: {entry.error[:300]}")
        for entry in entries:
            if entry.error is None and "adapters" in entry.scenarios:
                warm_adapters(setup, entry, prompts)
            if entry.error is None and real is not None:
                peers_real.warm_up(entry.server, entry.scenarios, prompts)
        for repeat in range(args.repeats):
            for entry in entries:
                for scenario in entry.scenarios:
                    if entry.error is not None:
                        continue
                    log(f"run {repeat + 1}/{args.repeats}: {entry.server.label} {scenario}")
                    try:
                        entry.runs.setdefault(scenario, []).append(
                            run_one(args, setup, entry, scenario, repeat, prompts, shared, arrivals))
                    except Exception as err:  # noqa: BLE001 - reported, not hidden
                        entry.error = f"{scenario}: {type(err).__name__}: {err}"
                        log(f"{entry.server.label} FAILED: {entry.error[:300]}")
        for entry in entries:
            if real is not None and entry.error is None:
                log(f"{entry.server.label}: greedy answers against transformers'")
                try:
                    entry.agreement = peers_real.agreement(entry.server, real)
                except Exception as err:  # noqa: BLE001 - reported, not hidden
                    entry.agreement = {"error": f"{type(err).__name__}: {err}"}
    finally:
        for entry in entries:
            entry.server.stop()
    return entries


def main() -> None:
    args = parse_args()
    shape = bench_model.SHAPES["cpu"]
    log(f"model {shape.name} ({shape.parameters() / 1e6:.0f}M params) under {args.model_root}")
    model_dir = bench_model.ensure_model(shape, args.model_root, "cpu").resolve()
    adapter_root = (args.model_root / f"{shape.name}-adapters").resolve()
    ids = adapters.ensure_adapters(model_dir, adapter_root, args.adapters, shape.dtype)
    shared = cache_scenarios.SharedPrefix(args.concurrency, args.prefix_tokens, args.suffix_tokens, args.max_tokens,
                                          args.requests_per_client)
    arrivals = cache_scenarios.LongArrivals(args.long_running, args.prompt_tokens, args.long_running_tokens,
                                            arrivals=args.long_arrivals,
                                            arrival_prompt_tokens=args.long_prompt_tokens)
    prompts = bench_model.prompts(args.concurrency * args.requests_per_client, args.prompt_tokens, shape.vocab_size)
    # Every server's log is kept beside the report.
    logs = args.results_dir / f"peers-logs-{time.strftime('%Y%m%d-%H%M%S')}"
    setup = Setup(model_dir, adapter_root, ids, shape.vocab_size, logs,
                  quiver_cache_flags=quiver_has_flag("--prefix-caching"))
    install_peers(args, setup)
    for family, reason in setup.unavailable.items():
        log(f"{family} UNAVAILABLE: {reason[:300]}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    kind = "cpu-quick" if args.quick else "cpu"
    path = args.results_dir / f"peers-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    entries = run_phase(args, setup, phase_a_servers(args, setup), prompts, shared, arrivals)
    # Phase A's report is written at once, so a run cut short in phase B keeps it.
    write_report(args, setup, entries, shared, arrivals, path, plot=False)
    entries += run_phase(args, setup, phase_b_servers(args, setup, shared, arrivals), prompts, shared, arrivals)
    real = None
    if "real" in args.scenarios:
        real = peers_real.prepare(args, setup.llama_dir, setup.convert_py, log)
        for group in peers_real.GROUPS:
            write_report(args, setup, entries, shared, arrivals, path, plot=False, real=real)
            group_entries = [Entry(server, scenarios) for server, scenarios in peers_real.group_servers(
                args, setup, real, group, lambda label, config: QuiverServer(
                    label, config, setup.logs, " ".join(config.args(0)[4:])))]
            if group_entries:
                entries += run_phase(args, setup, group_entries, real.prompts, shared, arrivals, real=real)
    report = write_report(args, setup, entries, shared, arrivals, path, plot=True, real=real)
    log(f"report written to {path}")
    print(json.dumps(report, indent=2))


def write_report(args, setup: Setup, entries: list[Entry], shared, arrivals, path: Path, plot: bool,
                 real: peers_real.RealSetup | None = None) -> dict:
    report = peers_report.build(args, setup, entries, shared, arrivals)
    if real is not None:
        report["real_model"] = peers_real.summary(args, real)
    if plot:
        plot_path = path.with_suffix(".png")
        try:
            peers_plot.plot(report, plot_path)
            report["plot"] = str(plot_path)
        except Exception as err:  # noqa: BLE001 - the figures matter more than their picture
            report["plot"] = {"error": f"{type(err).__name__}: {err}"}
    path.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
