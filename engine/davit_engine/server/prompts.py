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


def completion_prompt_ids(request: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """Tokenize the prompt, or check the token ids given. Raises OpenAIError(400)."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise OpenAIError(
                400, "'prompt' holds several prompts; send one prompt per request", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError(400, "'prompt' must not be empty", "prompt")
        return tokenizer.encode(prompt, add_special_tokens=True)
    ids = [int(t) for t in prompt]  # type: ignore[arg-type]  # narrowed to list[int] above
    if not ids:
        raise OpenAIError(400, "'prompt' must not be empty", "prompt")
    vocab = tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(400, f"'prompt' holds token id {bad}, outside [0, {vocab})", "prompt")
    return ids
