"""Startup memory measurement below the runners: the CUDA allocator's serving configuration and
the profiler that sizes the KV cache from probes each runner brings (the profile document it
produces is `davit_contract.profile`)."""
