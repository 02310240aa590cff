"""quiver shard: model weights, paged KV cache, batched prefill/decode over gRPC."""

import os

# Set before torch loads OpenMP. A CPU shard shares its cores with the router and the clients;
# OpenMP threads that spin at barriers then wait on each other whenever one is descheduled
# (decode steps measured 3-5x slower on 2 busy cores). Sleeping threads cost little when idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
