"""quiver shard: model weights, paged KV cache, batched prefill/decode over gRPC."""

import os

# Set before torch loads OpenMP. A CPU shard shares its cores with the router and the clients, so
# OpenMP threads must not spin for long: threads spinning at barriers wait on each other whenever
# one is descheduled (decode steps measured 3-5x slower on 2 busy cores with unbounded spinning).
# But a thread that sleeps at once takes 50-120 us to wake on a VM, and a step opens hundreds of
# parallel regions with a few microseconds of Python between them: GNU OpenMP (PyPI torch's) spins
# for GOMP_SPINCOUNT pause loops first, here well under a millisecond, so a step's regions find
# their threads awake and the gap between steps (router, sampling, gRPC) finds them asleep. On the
# 2-core bench VM this took 32-stream throughput up 12-17% (docs/benchmarks.md). Other OpenMP
# runtimes ignore GOMP_SPINCOUNT and sleep at once (PASSIVE).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "30000")
