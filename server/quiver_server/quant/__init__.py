"""Weight-only quantized projections: the one in-memory form every source maps onto
(`weights.QuantizedWeight`), quantization at load (`quantize`), and the formats read from
checkpoints and GGUF files. The kernels that multiply by these weights live in `kernels/`."""
