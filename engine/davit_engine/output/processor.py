"""One request's output processing, the same for the HTTP server and the offline `LLM`.

The engine core emits token ids only. Here they become text (incremental detokenization that
never splits a UTF-8 character), stop strings are matched (the core does not know about them:
when one matches, the caller aborts the request in the core), the finish reason and what
stopped the request are decided, and logprobs get their token text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from davit_engine.output.detokenizer import IncrementalDetokenizer, StopStringMatcher
from davit_engine.tokenizer import Tokenizer
from davit_engine.types import FinishReason, RequestDelta, SamplingParams, TokenLogprob

# JSON has no -inf; upstream clamps impossible tokens' logprobs to this value.
_MIN_LOGPROB = -9999.0


@dataclass
class LogprobEntry:
    """One generated token's logprob with its text, and the top alternatives best first."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class OutputPiece:
    """What one delta adds to the response. `finish_reason` is set on the last piece.

    A delta may carry several tokens (steps merged on the way); `logprobs` then holds one
    entry per token, in order.
    """

    text: str
    num_new_tokens: int
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stopped_by_string: bool = False  # the request is done here but the core does not know yet


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


class OutputProcessor:
    """Accumulates one request's output; feed it every delta in order with `process()`.

    Each `process()` returns the piece to send now; the whole output so far is in `text`,
    `token_ids`, `logprobs` (as the core reported them), `finish_reason` ("stop", "length" or
    "abort") and `stop_reason` (the stop string or stop token id that ended the request).
    `logprob_text=False` leaves the pieces' logprob entries empty, for callers that read the
    raw `logprobs` and need no token text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        logprob_text: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._logprob_text = logprob_text
        self._texts: list[str] = []
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=sampling.skip_special_tokens
        )
        self._stops = (
            StopStringMatcher(
                list(sampling.stop), include_stop_str=sampling.include_stop_str_in_output
            )
            if sampling.stop
            else None
        )
        self._token_text: dict[int, str] = {}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The output text so far (cut at the stop string, if one matched)."""
        return "".join(self._texts)

    def process(self, delta: RequestDelta) -> OutputPiece:
        """Turn one delta into the text and logprobs to send; idempotent after finishing."""
        if self.finished:
            return OutputPiece("", 0)
        if delta.num_prompt_tokens:
            self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.num_output_tokens += len(delta.new_token_ids)
        self.token_ids.extend(delta.new_token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        text = self._detokenizer.push(delta.new_token_ids)
        if delta.finished:
            text += self._detokenizer.finish()
        entries = self._logprob_entries(delta.logprobs) if self._logprob_text else []
        piece = OutputPiece("", len(delta.new_token_ids), entries)
        if self._stops is not None:
            text, stopped = self._stops.feed(text)
            if stopped:
                self._texts.append(text)
                piece.text = text
                piece.finish_reason = FinishReason.STOP.value
                piece.stopped_by_string = True
                self.finish_reason = piece.finish_reason
                self.stop_reason = self._stops.matched
                return piece
            if delta.finished:
                text += self._stops.flush()
        self._texts.append(text)
        piece.text = text
        if delta.finish_reason is not None:
            piece.finish_reason = delta.finish_reason.value
            self.finish_reason = piece.finish_reason
            self.stop_reason = delta.stop_token_id
        return piece

    def _logprob_entries(self, logprobs: list[TokenLogprob] | None) -> list[LogprobEntry]:
        return [
            LogprobEntry(
                self.token_text(lp.token_id),
                _finite(lp.logprob),
                [(self.token_text(tid), _finite(value)) for tid, value in lp.top],
            )
            for lp in logprobs or []
        ]

    def token_text(self, token_id: int) -> str:
        """A single token's text as OpenAI reports it in logprobs (special tokens included)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text
