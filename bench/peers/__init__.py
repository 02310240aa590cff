"""`make bench-peers` (`python -m bench.peers.run`): quiver beside vLLM's CPU build and llama.cpp's
llama-server on the same models and load; installing and starting the peers, GGUF conversion."""
