"""Offline Python API: `LLM(model, **engine flags).generate(prompts, SamplingParams(...))`.

Runs an `EngineCore` in this process and does the front end's text work itself: tokenization and
chat templates here, detokenization, stop strings and finish reasons in the output processor the
HTTP server uses too (a request whose text hits a stop string is aborted in the core so its KV
blocks are freed at once).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from davit_engine.config import EngineConfig
from davit_engine.core.scheduler import QueueFullError
from davit_engine.engine_core import EngineCore
from davit_engine.output.processor import OutputProcessor
from davit_engine.tokenizer import Tokenizer, load_tokenizer
from davit_engine.types import EngineRequest, ParamError, SamplingParams, TokenLogprob

PromptInput = str | list[str] | list[list[int]]
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}


@dataclass
class CompletionOutput:
    """One finished request. `finish_reason` is "stop", "length" or "abort"."""

    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class LLM:
    """An engine in this process. Keyword arguments are `EngineConfig` fields."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        unknown = sorted(set(engine_args) - _CONFIG_FIELDS)
        if unknown:
            raise ParamError(unknown[0], f"unknown engine argument {unknown[0]!r}")
        self.config = EngineConfig(model=model, **engine_args)
        self.core = EngineCore(self.config)
        self.tokenizer: Tokenizer = load_tokenizer(self.config)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptInput,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Complete each prompt (text, or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str):
            token_lists = [self.tokenizer.encode(prompts)]
        elif isinstance(prompts, list) and prompts:
            token_lists = []
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, str):
                    token_lists.append(self.tokenizer.encode(prompt))
                elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    token_lists.append(list(prompt))
                else:
                    raise ParamError("prompts", f"prompts[{i}] must be a string or a list of ints")
        else:
            raise ParamError("prompts", "prompts must be a string or a non-empty list")
        return self._run(token_lists, params)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        if not isinstance(messages, list) or not messages:
            raise ParamError("messages", "messages must be a non-empty list")
        conversations = messages if isinstance(messages[0], list) else [messages]
        token_lists = [
            self.tokenizer.apply_chat_template(conversation) for conversation in conversations
        ]
        return self._run(token_lists, params)

    def _run(
        self,
        token_lists: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[CompletionOutput]:
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(token_lists)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(token_lists):
                raise ParamError(
                    "params",
                    f"got {len(per_prompt)} SamplingParams for {len(token_lists)} prompts",
                )
        # One output processor per request, in prompt order (the server uses the same one).
        outputs: dict[str, OutputProcessor] = {}
        pending: list[EngineRequest] = []
        for ids, p in zip(token_lists, per_prompt, strict=True):
            request_id = f"llm-{next(self._ids)}"
            pending.append(
                EngineRequest(request_id, ids, p, eos_token_ids=self.tokenizer.eos_token_ids)
            )
            outputs[request_id] = OutputProcessor(self.tokenizer, ids, p, logprob_text=False)
        unfinished = set(outputs)
        try:
            while unfinished:
                pending = self._admit(pending)
                for delta in self.core.step():
                    output = outputs.get(delta.request_id)
                    if output is None or output.finished:
                        continue  # the ABORT echo of a request stopped by a stop string
                    output.process(delta)
                    if output.finished:
                        unfinished.discard(delta.request_id)
                        if not delta.finished:  # a stop string: the core would go on
                            self.core.abort_requests([delta.request_id])
        except BaseException:
            self.core.abort_requests(unfinished)
            raise
        self._drain()
        return [
            CompletionOutput(
                prompt_token_ids=o.prompt_token_ids,
                text=o.text,
                token_ids=o.token_ids,
                finish_reason=o.finish_reason,
                logprobs=o.logprobs if o.sampling.logprobs is not None else None,
                num_cached_tokens=o.num_cached_tokens,
                stop_reason=o.stop_reason,
            )
            for o in outputs.values()
        ]

    def _admit(self, pending: list[EngineRequest]) -> list[EngineRequest]:
        """Add as many pending requests as the queue takes; the rest wait for a later step."""
        for i, req in enumerate(pending):
            try:
                self.core.add_request(req)
            except QueueFullError:
                return pending[i:]
        return []

    def _drain(self) -> None:
        """Collect the ABORT deltas of requests stopped by stop strings."""
        while self.core.has_unfinished_requests():
            self.core.step()

    def shutdown(self) -> None:
        self.core.shutdown()
