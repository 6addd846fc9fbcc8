"""What the operator and the engine agree on, importable without torch or kopf.

- `profile`: the memory profile document an engine writes and the operator reads.
- `engine_defaults`: the engine's flag defaults, which the operator plans with when a spec
  leaves a limit unset.
- `graphs`: runner V2's decode-graph batch sizes and the estimate of their memory.
"""
