"""Quantization applied to a loaded model from outside: FP8 projection weights (`fp8_linear`),
the scales of an FP8 KV cache (`kv_scales`) and where FP8 can run (`support`).

The model composition stays unquantized (models/llama.py); the loader swaps its projections for
`Fp8Linear` and sets each attention layer's `kv_scale` after (or, for FP8 checkpoints, before)
the weights are in place.
"""
