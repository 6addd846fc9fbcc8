"""Davit engine: an LLM serving engine with an OpenAI-compatible HTTP API.

Requests flow down and token deltas flow back up: the HTTP `server` (or the offline `llm`)
tokenizes, validates and sends requests through `ipc` to the `engine_core`, whose
`step_pipeline` drives the `core` scheduler and a `runner` (built on `kernels`, `layers`,
`models`, `loader` and `memory`); the `output` processor turns the deltas back into text.
`bench` holds the user-facing `davit bench throughput|serve`.

A module imports only modules of its own layer or lower ones (imports inside functions count):

Layers (lowest first): types, spec_decode, config, core, layers, kernels, models, quant, shapes, loader, tokenizer, output, memory, runner, offload, engine_flags, isolating_runner, rank_workers, step_pipeline, engine_core, ipc, llm, server, bench
"""

__version__ = "0.1.0"
