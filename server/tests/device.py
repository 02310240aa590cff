"""The device the model-level shard tests run on: CPU, or what QUIVER_TEST_DEVICE names
(`make gpu-check` and the GPU runs set it to cuda). References stay on the CPU in float32."""

import os

import torch

TEST_DEVICE = torch.device(os.environ.get("QUIVER_TEST_DEVICE", "cpu"))
