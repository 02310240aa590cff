"""Session set-up shared by the shard tests.

Without a GPU, Triton kernels can only run in Triton's CPU interpreter, and TRITON_INTERPRET must
be set before the first `import triton` (triton.language's own helpers are decorated then, and
torch._dynamo imports triton as soon as transformers' generation code loads, i.e. while pytest
collects the first test module). Nothing else in the shard uses Triton, so this changes nothing
for other tests; with a GPU the flag stays unset and kernel tests run compiled on the device.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items: list) -> None:
    """Every test in a `test_cpu_*.py` module is about the C++ CPU kernels (the cpu_kernels marker:
    `make test` runs them once per vector ISA the host runs, and not in its QUIVER_CPU_KERNELS=0
    pass); other modules mark their kernel tests one by one."""
    for item in items:
        if item.path.name.startswith("test_cpu_"):
            item.add_marker(pytest.mark.cpu_kernels)
