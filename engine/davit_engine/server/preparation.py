"""Prompt preparation off the event loop: chat-template rendering and tokenization.

Tokenizing a multi-megabyte prompt takes seconds; on the event loop it would stall every
other request, stream, probe and scrape for that long. Every prompt is therefore prepared in
a worker thread (the tokenizers release the interpreter lock while they work). Prompts of
LARGE_PROMPT_CHARS or more take turns on one of the threads, so the others stay free for
ordinary requests and at most one huge prompt's working memory exists at a time; after one,
the freed memory goes back to the system (see connections.release_memory).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from davit_engine.server.protocol import ChatCompletionRequest, CompletionRequest

P = ParamSpec("P")
T = TypeVar("T")

LARGE_PROMPT_CHARS = 256 * 1024
_NUM_THREADS = 2


def prompt_size(body: ChatCompletionRequest | CompletionRequest) -> int:
    """Characters (or token ids) of prompt the body holds: what preparing it costs."""
    if isinstance(body, ChatCompletionRequest):
        return sum(len(message.text) for message in body.messages)
    return sum(len(prompt) for prompt in body.prompts())


class PromptPreparer:
    """Runs preparation functions in its worker threads. Methods run on one event loop."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(_NUM_THREADS, thread_name_prefix="davit-prompt")
        self._large_turn: asyncio.Lock | None = None

    async def run(self, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` in a worker thread; `size` as `prompt_size` counts it."""
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, **kwargs)
        if size < LARGE_PROMPT_CHARS:
            return await loop.run_in_executor(self._pool, call)
        if self._large_turn is None:
            self._large_turn = asyncio.Lock()
        async with self._large_turn:
            return await loop.run_in_executor(self._pool, call)

    def shutdown(self) -> None:
        """Stop taking work; a preparation still running finishes in its thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)
