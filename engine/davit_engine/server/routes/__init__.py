"""HTTP routers: OpenAI chat and completions, and the operational endpoints."""
