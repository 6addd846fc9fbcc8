"""Catalog evidence: facts about upstream vLLM releases read from their own wheels.

`python -m davit_tools.catalog.evidence VERSION...` writes `evidence/vllm-VERSION.json` per
release (see README.md). Readers of the wheel: `wheel` (the artifact), `pysource` (ast
helpers), `runners`, `features`, `flags`, `build` (with `elf`); `sections` and `contract` turn
their findings into the file's sections, `summary` derives what the release does with each
feature, `schema` is the file's format. The contract check: `command_lines` (the operator's
planner), `parser_check` (the throwaway environment) and `parse_driver` (run inside it).
"""
