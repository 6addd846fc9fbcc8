"""The offline API on a tiny random model: stop strings, seeds, logprobs, chat, bad input."""

from __future__ import annotations

import pytest

from davit_engine.llm import LLM
from davit_engine.types import ParamError, SamplingParams

PROMPTS = ["Once upon a time", "The quick brown fox", "Numbers: 1 2 3", "Hello"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("random:qwen3-tiny", dtype="float32", num_gpu_blocks=128)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.core.stats()
    assert not llm.core.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_text_is_the_decoded_tokens(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for out in outputs:
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids)
    assert_all_blocks_free(llm)


def pick_stop(text: str) -> str:
    for k in range(3, len(text) - 2):
        stop = text[k : k + 2]
        if "\ufffd" not in stop and text.find(stop) == k:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_and_frees_the_request(llm: LLM, include: bool) -> None:
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    (full,) = llm.generate([PROMPTS[0]], greedy)
    stop = pick_stop(full.text)
    cut = full.text.index(stop)
    params = SamplingParams(
        max_tokens=30,
        temperature=0.0,
        ignore_eos=True,
        stop=(stop,),
        include_stop_str_in_output=include,
    )
    (out,) = llm.generate([PROMPTS[0]], params)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (full.text[: cut + len(stop)] if include else full.text[:cut])
    assert len(out.token_ids) < 30  # the request was aborted in the core, not run to the end
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert_all_blocks_free(llm)


def test_seeded_sampling_is_reproducible_in_any_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    (alone,) = llm.generate([PROMPTS[1]], seeded)
    batch = llm.generate(
        PROMPTS,
        [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 1
        + [seeded]
        + [SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True)] * 2,
    )
    assert batch[1].token_ids == alone.token_ids
    (other_seed,) = llm.generate(
        [PROMPTS[1]], SamplingParams(max_tokens=16, temperature=1.0, seed=43, ignore_eos=True)
    )
    assert other_seed.token_ids != alone.token_ids


def test_logprobs(llm: LLM) -> None:
    (out,) = llm.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    )
    assert out.logprobs is not None and len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob <= 0.0
        assert len(lp.top) == 3
        # Greedy: the chosen token is the most likely one.
        assert lp.top[0][0] == token and lp.top[0][1] == pytest.approx(lp.logprob)
    (plain,) = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2, temperature=0.0))
    assert plain.logprobs is None


def test_chat_and_token_prompts(llm: LLM) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (chat,) = llm.chat(conversation, params)
    ids = llm.tokenizer.apply_chat_template(conversation)
    (same,) = llm.generate([ids], params)
    assert chat.prompt_token_ids == ids and chat.token_ids == same.token_ids
    two = llm.chat([conversation, conversation[1:]], params)
    assert len(two) == 2 and two[0].token_ids == chat.token_ids


def test_bad_input_names_the_field(llm: LLM) -> None:
    with pytest.raises(ParamError) as err:
        llm.chat([], SamplingParams())
    assert err.value.param == "messages"
    with pytest.raises(ParamError) as err:
        llm.chat([{"role": "wizard", "content": "x"}])
    assert err.value.param == "messages"
    with pytest.raises(ParamError) as err:
        llm.generate(PROMPTS, [SamplingParams()] * 2)
    assert err.value.param == "params"
    with pytest.raises(ParamError) as err:
        llm.generate([["not", "ids"]])  # type: ignore[list-item]
    assert err.value.param == "prompts"
    with pytest.raises(ParamError) as err:
        llm.generate(["x"], SamplingParams(top_p=0.0))
    assert err.value.param == "top_p"
    with pytest.raises(ParamError) as err:
        LLM("random:qwen3-tiny", max_num_sequences=3)
    assert err.value.param == "max_num_sequences"
    assert_all_blocks_free(llm)
