"""Building blocks shared by every model family: norms, rotary embeddings, linear, paged attention."""
