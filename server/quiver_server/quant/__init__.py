"""Weight-only quantized projections: the one in-memory form every source maps onto
(`weights.QuantizedWeight`), quantization at load (`quantize`), and the formats read from
checkpoints and GGUF files. The kernels that multiply by these weights live in `kernels/`."""

# int4's default group (`--quantize-group-size`), here so that the CLI reads it without torch:
# llama.cpp's Q4 block; 128 loses too much without calibration (quantize.py says why).
DEFAULT_INT4_GROUP = 32
