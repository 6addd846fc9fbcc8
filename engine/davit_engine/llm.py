"""Offline Python API: `LLM(model, **engine flags).generate(prompts, SamplingParams(...))`.

Runs an `EngineCore` in this process and does the front end's text work itself: tokenization,
chat templates, incremental detokenization and stop strings (a request whose text hits a stop
string is aborted in the core so its KV blocks are freed at once).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from davit_engine.config import EngineConfig
from davit_engine.core.scheduler import QueueFullError
from davit_engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from davit_engine.engine_core import EngineCore
from davit_engine.tokenizer import Tokenizer, load_tokenizer
from davit_engine.types import (
    EngineRequest,
    FinishReason,
    ParamError,
    RequestDelta,
    SamplingParams,
    TokenLogprob,
)

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


@dataclass
class _Tracked:
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0


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
        tracked: dict[str, _Tracked] = {}
        pending: list[EngineRequest] = []
        for i, (ids, p) in enumerate(zip(token_lists, per_prompt, strict=True)):
            request_id = f"llm-{next(self._ids)}"
            pending.append(
                EngineRequest(request_id, ids, p, eos_token_ids=self.tokenizer.eos_token_ids)
            )
            tracked[request_id] = _Tracked(
                index=i,
                prompt_token_ids=ids,
                params=p,
                detokenizer=IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens),
                stops=StopStringMatcher(p.stop, p.include_stop_str_in_output),
            )
        unfinished = set(tracked)
        try:
            while unfinished:
                pending = self._admit(pending)
                for delta in self.core.step():
                    state = tracked.get(delta.request_id)
                    if state is None or state.finish_reason is not None:
                        continue  # the ABORT echo of a request stopped by a stop string
                    if self._apply(state, delta):
                        unfinished.discard(delta.request_id)
                        if delta.finish_reason is None:
                            self.core.abort_requests([delta.request_id])
        except BaseException:
            self.core.abort_requests(unfinished)
            raise
        self._drain()
        ordered = sorted(tracked.values(), key=lambda s: s.index)
        return [
            CompletionOutput(
                prompt_token_ids=s.prompt_token_ids,
                text=s.text,
                token_ids=s.token_ids,
                finish_reason=s.finish_reason,
                logprobs=s.logprobs if s.params.logprobs is not None else None,
                num_cached_tokens=s.num_cached_tokens,
                stop_reason=s.stop_reason,
            )
            for s in ordered
        ]

    def _admit(self, pending: list[EngineRequest]) -> list[EngineRequest]:
        """Add as many pending requests as the queue takes; the rest wait for a later step."""
        for i, req in enumerate(pending):
            try:
                self.core.add_request(req)
            except QueueFullError:
                return pending[i:]
        return []

    def _apply(self, state: _Tracked, delta: RequestDelta) -> bool:
        """Fold one delta into `state`; True when the request is done (text-wise or core-wise)."""
        state.token_ids.extend(delta.new_token_ids)
        state.num_cached_tokens = delta.num_cached_tokens
        if delta.logprobs:
            state.logprobs.extend(delta.logprobs)
        text = state.detokenizer.push(delta.new_token_ids)
        if delta.finished:
            text += state.detokenizer.finish()
        emitted, stopped = state.stops.feed(text)
        state.text += emitted
        if stopped:
            state.finish_reason = FinishReason.STOP.value
            state.stop_reason = state.stops.matched
            return True
        if delta.finished:
            state.text += state.stops.flush()
            assert delta.finish_reason is not None
            state.finish_reason = delta.finish_reason.value
            state.stop_reason = delta.stop_token_id
            return True
        return False

    def _drain(self) -> None:
        """Collect the ABORT deltas of requests stopped by stop strings."""
        while self.core.has_unfinished_requests():
            self.core.step()

    def shutdown(self) -> None:
        self.core.shutdown()
