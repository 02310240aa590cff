"""The demo `quiver-launcher` serves without `--model-id`: a real instruct model (SmolLM2-135M-
Instruct) and a LoRA adapter trained on it (`demo/` in the repository holds its training script
and data)."""
