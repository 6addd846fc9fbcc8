"""Incremental detokenization (never half a UTF-8 character) and stop-string hold-back."""

from __future__ import annotations

from pathlib import Path

import pytest

from davit_engine.config import EngineConfig
from davit_engine.output.detokenizer import IncrementalDetokenizer, StopStringMatcher
from davit_engine.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

TEXT = "Grüße 👋🏽 from 東京, naïve café ✓"


def stream(tokenizer: Tokenizer, prompt: list[int], ids: list[int], chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_byte_tokens_never_split_a_character(chunk: int) -> None:
    tokenizer = ByteTokenizer(vocab_size=300, bos_token_id=256, eos_token_ids=(257,))
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT)  # multi-byte characters span several tokens
    deltas = stream(tokenizer, tokenizer.encode("hi"), ids + [257], chunk)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # The 4-byte emoji arrives in one delta, whole.
    assert any("👋" in d for d in deltas)


def test_truncated_character_is_released_at_finish() -> None:
    tokenizer = ByteTokenizer(vocab_size=300, bos_token_id=None, eos_token_ids=())
    ids = tokenizer.encode("ok 東", add_special_tokens=False)[:-1]  # cut inside the character
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.push(ids) == "ok "
    assert detok.finish() == "\ufffd"


def test_real_tokenizer_emoji_and_cjk(smollm2_gguf: Path) -> None:
    tokenizer = load_tokenizer(EngineConfig(model=str(smollm2_gguf)))
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = tokenizer.encode("Say hello:", add_special_tokens=False)
    deltas = stream(tokenizer, prompt, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # Byte-level BPE spreads the emoji over several tokens: some pushes must have held back.
    assert deltas.count("") > 1


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    emitted = []
    stopped = False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted.append(text)
        if stopped:
            break
    if not stopped:
        emitted.append(matcher.flush())
    return emitted, stopped


def test_stop_string_split_across_deltas_is_held_back() -> None:
    matcher = StopStringMatcher(["</end>"])
    emitted, stopped = feed_all(matcher, ["Hello <", "/e", "nd> ignored"])
    assert stopped and matcher.matched == "</end>"
    assert emitted == ["Hello ", "", ""]
    assert "".join(emitted) == "Hello "


def test_include_stop_string() -> None:
    matcher = StopStringMatcher(["STOP"], include_stop_str=True)
    emitted, stopped = feed_all(matcher, ["abc ST", "OP def"])
    assert stopped and "".join(emitted) == "abc STOP"


def test_false_partial_match_is_released() -> None:
    matcher = StopStringMatcher(["<|end|>"])
    emitted, stopped = feed_all(matcher, ["a <", "| b", " c"])
    assert not stopped
    assert emitted == ["a ", "<| b", " c", ""]


def test_earliest_of_several_stops_wins() -> None:
    matcher = StopStringMatcher(["world", "lo w"])
    emitted, stopped = feed_all(matcher, ["hello world"])
    assert stopped and matcher.matched == "lo w" and emitted == ["hel"]


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    with pytest.raises(ValueError):
        StopStringMatcher([""])
