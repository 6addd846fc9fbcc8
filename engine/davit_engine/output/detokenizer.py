"""Incremental detokenization and stop-string matching for streamed output.

Byte-level tokenizers can split one UTF-8 character over several tokens; decoding such a
prefix yields U+FFFD. The detokenizer therefore decodes a small sliding window of tokens and
only releases text once it no longer ends in U+FFFD, so a client never sees half a character.
"""

from __future__ import annotations

from collections.abc import Sequence

from davit_engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context: tokenizers that render a leading space differently at
# the start of a string (SentencePiece) need one real token before the first output token.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    `push(new_ids)` returns only the text that became complete with these tokens; `finish()`
    returns what is still held back (a trailing incomplete character, as U+FFFD) at the end.
    The concatenation of all deltas equals decoding all output tokens at once, except where
    a tokenizer's decoding of a window differs from decoding the whole (it does not for
    byte-level BPE).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # The window ids[prefix:] is decoded on each push; its first `emitted` characters are
        # already out (the prompt context counts as out). `read` is where the window's last
        # fully decoded state ended: the next window starts there.
        self._prefix = 0
        self._read = len(self._ids)
        self._emitted = len(self._decode(self._ids))
        self.output_text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, self._skip_special)

    def push(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(new_ids)
        full = self._decode(self._ids[self._prefix :])
        # An incomplete trailing character decodes as U+FFFD: hold it back until it completes.
        complete = full.rstrip(REPLACEMENT_CHAR)
        delta = complete[self._emitted :] if len(complete) > self._emitted else ""
        self._emitted = max(self._emitted, len(complete))
        if len(complete) == len(full):
            # Nothing held back: slide the window so decoding stays O(new tokens).
            self._prefix = self._read
            self._read = len(self._ids)
            self._emitted = len(self._decode(self._ids[self._prefix :]))
        self.output_text += delta
        return delta

    def finish(self) -> str:
        """Release any held-back text (an incomplete final character becomes U+FFFD)."""
        full = self._decode(self._ids[self._prefix :])
        delta = full[self._emitted :]
        self._prefix = self._read = len(self._ids)
        self._emitted = 0
        self.output_text += delta
        return delta


class StopStringMatcher:
    """Cuts streamed text at the first stop string, holding back possible partial matches.

    `feed(text)` returns `(text safe to emit, stopped)`. While the tail of the stream could
    still grow into a stop string, that tail is held back; once a stop string appears, the
    text before it is emitted (plus the stop string itself when `include_stop_str`) and
    `stopped` is True. `flush()` releases the held-back tail at the end of the stream.
    """

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._include = include_stop_str
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._pending + text
        first: tuple[int, str] | None = None
        for stop in self._stops:
            index = buffer.find(stop)
            if index >= 0 and (first is None or index < first[0]):
                first = (index, stop)
        if first is not None:
            index, stop = first
            self.stopped = True
            self.matched = stop
            self._pending = ""
            return buffer[: index + len(stop)] if self._include else buffer[:index], True
        hold = self._partial_match_len(buffer)
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return "" if self.stopped else pending

    def _partial_match_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
