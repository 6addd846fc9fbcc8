"""Model compositions (Llama, Qwen2, Qwen3 families) built from `davit_engine.layers`."""
