"""Turning request bodies into prompt token ids."""

from __future__ import annotations

from typing import Any

from davit_engine.server.errors import OpenAIError
from davit_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from davit_engine.tokenizer import Tokenizer
from davit_engine.types import ParamError


def chat_prompt_ids(request: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """Render the messages with the model's chat template. Raises OpenAIError(400)."""
    if not request.messages:
        raise OpenAIError(400, "'messages' must contain at least one message", "messages")
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        if isinstance(message.content, list):
            content = "".join(part.text for part in message.content)
        else:
            content = message.content or ""
        entry: dict[str, Any] = {"role": message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        if message.role == "user" and not content:
            raise OpenAIError(400, f"'messages[{i}].content' must not be empty", f"messages[{i}]")
        messages.append(entry)
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=request.add_generation_prompt
        )
    except ParamError as exc:
        raise OpenAIError(400, exc.message, exc.param) from exc


# More prompts than this in one request are refused: each becomes a separate engine request.
MAX_PROMPTS = 64


def completion_prompts(request: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids for each prompt: a string, token ids, or a list of either. OpenAIError(400)."""
    prompt = request.prompt
    batch: list[str | list[int]] = []
    if isinstance(prompt, str):
        batch = [prompt]
    elif prompt and isinstance(prompt[0], int):
        # The strict request model admits only lists of one kind, so the first item tells.
        batch = [list(prompt)]
    else:
        batch = list(prompt)  # type: ignore[arg-type]  # strings or token-id lists
    if not batch:
        raise OpenAIError(400, "'prompt' must not be empty", "prompt")
    if len(batch) > MAX_PROMPTS:
        raise OpenAIError(
            400, f"'prompt' holds {len(batch)} prompts; at most {MAX_PROMPTS} are allowed", "prompt"
        )
    param = "prompt" if len(batch) == 1 else None
    return [_prompt_ids(item, tokenizer, param or f"prompt[{i}]") for i, item in enumerate(batch)]


def _prompt_ids(prompt: str | list[int], tokenizer: Tokenizer, param: str) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError(400, f"'{param}' must not be empty", param)
        return tokenizer.encode(prompt, add_special_tokens=True)
    if not prompt:
        raise OpenAIError(400, f"'{param}' must not be empty", param)
    vocab = tokenizer.vocab_size
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise OpenAIError(400, f"'{param}' holds token id {bad}, outside [0, {vocab})", param)
    return list(prompt)
