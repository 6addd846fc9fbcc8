"""The OpenAI-compatible HTTP front end: app factory, routers, protocol models and metrics."""
