"""Speculative decoding, the torch-free half: the configuration, the n-gram proposer and the
acceptance statistics.

The scheduler (`core`) asks the n-gram proposer for draft tokens and counts the acceptance; the
device half (the draft model, the verification of drafts against the target's logits, the
CUDA graphs of a verification step) lives in runner V2 (`runner/v2/speculative.py`,
`runner/v2/draft_model.py`) and `kernels/rejection.py`.
"""
