"""Output processing shared by the HTTP server and the offline `LLM`: token-id deltas to text,
stop strings, finish reasons and logprobs."""
