"""Davit engine: an LLM serving engine with an OpenAI-compatible HTTP API."""

__version__ = "0.1.0"
