"""Session set-up shared by the shard tests.

Without a GPU, Triton kernels can only run in Triton's CPU interpreter, and TRITON_INTERPRET must
be set before the first `import triton` (triton.language's own helpers are decorated then, and
torch._dynamo imports triton as soon as transformers' generation code loads, i.e. while pytest
collects the first test module). Nothing else in the shard uses Triton, so this changes nothing
for other tests; with a GPU the flag stays unset and kernel tests run compiled on the device.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
