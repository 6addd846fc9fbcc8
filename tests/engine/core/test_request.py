"""Stop rules of a single request: EOS, stop token ids, min_tokens, max_tokens, max_model_len."""

from __future__ import annotations

from typing import Any

from davit_engine.core.request import Request, RequestStatus
from davit_engine.types import EngineRequest, FinishReason, SamplingParams

EOS = 2


def make(prompt_len: int = 3, **sampling: Any) -> Request:
    params = SamplingParams(**sampling)
    return Request.from_engine_request(
        EngineRequest("r", list(range(10, 10 + prompt_len)), params, eos_token_ids=(EOS,))
    )


def test_new_request_copies_prompt_and_starts_waiting() -> None:
    prompt = [5, 6, 7]
    req = Request.from_engine_request(EngineRequest("r", prompt, SamplingParams()))
    req.append_output_token(8, max_model_len=100)
    assert prompt == [5, 6, 7]
    assert req.token_ids == [5, 6, 7, 8]
    assert req.output_token_ids == [8]
    assert (req.num_prompt_tokens, req.num_output_tokens, req.num_tokens) == (3, 1, 4)
    assert req.status is RequestStatus.WAITING


def test_eos_stops_without_reporting_a_stop_token() -> None:
    req = make(max_tokens=10)
    assert req.append_output_token(7, 100) is None
    assert req.append_output_token(EOS, 100) is FinishReason.STOP
    assert req.stop_token_id is None


def test_ignore_eos_keeps_going_until_max_tokens() -> None:
    req = make(max_tokens=3, ignore_eos=True)
    assert req.append_output_token(EOS, 100) is None
    assert req.append_output_token(EOS, 100) is None
    assert req.append_output_token(EOS, 100) is FinishReason.LENGTH


def test_stop_token_id_is_reported() -> None:
    req = make(max_tokens=10, stop_token_ids=(42, 43))
    assert req.append_output_token(41, 100) is None
    assert req.append_output_token(43, 100) is FinishReason.STOP
    assert req.stop_token_id == 43


def test_stop_token_ids_apply_even_with_ignore_eos() -> None:
    req = make(max_tokens=10, ignore_eos=True, stop_token_ids=(EOS,))
    assert req.append_output_token(EOS, 100) is FinishReason.STOP
    assert req.stop_token_id == EOS


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    req = make(max_tokens=10, min_tokens=3, stop_token_ids=(42,))
    assert req.append_output_token(EOS, 100) is None
    assert req.append_output_token(42, 100) is None
    assert req.append_output_token(EOS, 100) is FinishReason.STOP


def test_max_tokens_gives_length() -> None:
    req = make(max_tokens=2)
    assert req.append_output_token(7, 100) is None
    assert req.append_output_token(7, 100) is FinishReason.LENGTH


def test_max_model_len_gives_length() -> None:
    req = make(prompt_len=3, max_tokens=100)
    assert req.append_output_token(7, 5) is None  # 4 tokens
    assert req.append_output_token(7, 5) is FinishReason.LENGTH  # 5 tokens


def test_eos_wins_over_length_on_the_same_token() -> None:
    req = make(max_tokens=1)
    assert req.append_output_token(EOS, 100) is FinishReason.STOP
