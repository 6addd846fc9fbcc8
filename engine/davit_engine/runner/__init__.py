"""Model runners: the only code that touches device state (weights, KV cache, CUDA graphs)."""
