"""The output processor both front ends use: text, stop strings, finish and stop reasons,
logprobs, for the HTTP server's pieces and the offline LLM's whole output alike."""

from __future__ import annotations

import math

from davit_engine.output.processor import OutputProcessor
from davit_engine.tokenizer import ByteTokenizer
from davit_engine.types import FinishReason, RequestDelta, SamplingParams, TokenLogprob

TOKENIZER = ByteTokenizer(512, None, (257,))
PROMPT = list(b"hi")


def delta(
    text: str,
    finish: FinishReason | None = None,
    stop_token: int | None = None,
    logprobs: bool = False,
) -> RequestDelta:
    ids = list(text.encode()) + ([stop_token] if stop_token is not None else [])
    lps = (
        [TokenLogprob(t, -1.0, [(t, -1.0), (t + 1, -math.inf)]) for t in ids] if logprobs else None
    )
    return RequestDelta("r", ids, lps, finish, stop_token, num_prompt_tokens=2, num_cached_tokens=1)


def test_a_stop_string_cuts_the_text_and_names_itself() -> None:
    output = OutputProcessor(TOKENIZER, PROMPT, SamplingParams(stop=("lazy",)))
    pieces = [output.process(delta("The quick la")), output.process(delta("zy dog"))]
    assert [p.text for p in pieces] == ["The quick ", ""]
    assert pieces[1].stopped_by_string and pieces[1].finish_reason == "stop"
    assert output.text == "The quick " and output.stop_reason == "lazy"
    assert output.token_ids == list(b"The quick lazy dog")
    # Later deltas (the core's ABORT echo) change nothing.
    assert output.process(delta("", FinishReason.ABORT)).text == ""
    assert output.finish_reason == "stop" and output.num_output_tokens == 18


def test_the_core_finishing_gives_its_reason_and_stop_token() -> None:
    output = OutputProcessor(TOKENIZER, PROMPT, SamplingParams(stop=("zzz",)))
    output.process(delta("ab z"))
    last = output.process(delta("c", FinishReason.STOP, stop_token=257))
    assert not last.stopped_by_string and last.finish_reason == "stop"
    assert output.text == "ab zc" and output.stop_reason == 257
    length = OutputProcessor(TOKENIZER, PROMPT, SamplingParams())
    length.process(delta("abc", FinishReason.LENGTH))
    assert length.finish_reason == "length" and length.stop_reason is None
    assert (length.num_prompt_tokens, length.num_cached_tokens) == (2, 1)


def test_logprobs_with_token_text_or_raw() -> None:
    sampling = SamplingParams(logprobs=1)
    server = OutputProcessor(TOKENIZER, PROMPT, sampling)
    piece = server.process(delta("ok", logprobs=True))
    assert [e.token for e in piece.logprobs] == ["o", "k"]
    # JSON has no -inf: impossible alternatives are clamped.
    assert piece.logprobs[0].top == [("o", -1.0), ("p", -9999.0)]
    offline = OutputProcessor(TOKENIZER, PROMPT, sampling, logprob_text=False)
    assert offline.process(delta("ok", logprobs=True)).logprobs == []
    assert [lp.token_id for lp in offline.logprobs] == list(b"ok")
    assert offline.logprobs == server.logprobs
