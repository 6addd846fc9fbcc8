"""Turning checked request bodies into prompt token ids (`check()` has run on the body)."""

from __future__ import annotations

from typing import Any

from davit_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from davit_engine.tokenizer import Tokenizer
from davit_engine.types import ParamError


def chat_prompt_ids(
    request: ChatCompletionRequest, tokenizer: Tokenizer, content_special_tokens: bool = False
) -> list[int]:
    """Render the messages with the model's chat template. Raises ParamError("messages").

    Special-token text in message content stays text unless `content_special_tokens`.
    """
    messages: list[dict[str, Any]] = []
    for message in request.messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.text}
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry)
    return tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=request.add_generation_prompt,
        content_special_tokens=content_special_tokens,
    )


def completion_prompts(request: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids for each prompt; ParamError names a prompt whose token ids the tokenizer does
    not know."""
    batch = request.prompts()
    param = "prompt" if len(batch) == 1 else None
    return [_prompt_ids(item, tokenizer, param or f"prompt[{i}]") for i, item in enumerate(batch)]


def _prompt_ids(prompt: str | list[int], tokenizer: Tokenizer, param: str) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    vocab = tokenizer.vocab_size
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ParamError(param, f"'{param}' holds token id {bad}, outside [0, {vocab})")
    return list(prompt)
