"""Building blocks shared by the model compositions: norms, rotary embeddings, attention."""
