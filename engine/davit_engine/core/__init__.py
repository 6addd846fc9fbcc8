"""Request state, block manager, prefix cache and scheduler. Pure Python: never imports torch."""
