"""Tokenizer loading, the byte-level fallback, and chat-message validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from davit_engine.config import EngineConfig
from davit_engine.tokenizer import ByteTokenizer, load_tokenizer, validate_messages
from davit_engine.types import ParamError


def test_random_models_get_a_byte_tokenizer() -> None:
    tokenizer = load_tokenizer(EngineConfig(model="random:qwen3-0.6b"))
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.vocab_size == 151936 and tokenizer.eos_token_ids == (151645, 151643)
    ids = tokenizer.encode("héllo")
    assert ids[0] == 151643 and tokenizer.decode(ids) == "héllo"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # Ids above the byte range decode to printable ASCII, so random output stays readable.
    assert tokenizer.decode([1000, 151645]).isprintable()
    assert tokenizer.decode([151645], skip_special_tokens=False) == "<|special_151645|>"
    assert tokenizer.convert_ids_to_tokens([65, 151645]) == ["<0x41>", "<|special_151645|>"]


def test_directory_without_tokenizer_names_the_flag(qwen3_tiny_dir: Path) -> None:
    with pytest.raises(ParamError) as err:
        load_tokenizer(EngineConfig(model=str(qwen3_tiny_dir)))
    assert err.value.param == "tokenizer" and "--tokenizer byte" in err.value.message
    byte = load_tokenizer(EngineConfig(model=str(qwen3_tiny_dir), tokenizer="byte"))
    assert byte.vocab_size == 512


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], "messages[0] must be an object"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content is required"),
        ([{"role": "user", "content": 5}], "string or a list of parts"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content parts"),
    ],
)
def test_invalid_messages(messages: object, fragment: str) -> None:
    with pytest.raises(ParamError) as err:
        validate_messages(messages)
    assert err.value.param == "messages" and fragment in err.value.message


def test_text_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert validate_messages([{"role": "user", "content": parts}]) == [
        {"role": "user", "content": "ab"}
    ]
    assert validate_messages([{"role": "assistant", "content": None}])[0]["content"] == ""
