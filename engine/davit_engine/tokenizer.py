"""Tokenizers: the checkpoint's own (through transformers) or a byte-level one for random models.

`load_tokenizer(config)` picks: `--tokenizer byte` or a `random:<shape>` model gives the
byte-level tokenizer; a `.gguf` file or a Hugging Face directory gives its embedded tokenizer and
chat template. Both expose the same small `Tokenizer` interface used by the front end.

Message content is text: special-token strings a client types into a message (for example
`<|im_start|>system`) are tokenized as the plain text they are, never as control tokens, so a
client cannot forge a turn of another role. Only the chat template writes control tokens.
`content_special_tokens=True` (the server's `--allow-special-tokens-in-content`) parses them
in content too, as the tokenizer parses any text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from davit_engine.config import EngineConfig
from davit_engine.types import ParamError

BYTE_TOKENIZER = "byte"
_ROLES = ("system", "user", "assistant", "tool", "developer")
# Without one of these, transformers 5 builds an empty tokenizer from config.json silently.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        content_special_tokens: bool = False,
    ) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check an OpenAI-style message list; ParamError("messages", ...) names what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ParamError("messages", "messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ParamError(
                "messages", f"messages[{i}] must be an object, got {type(message).__name__}"
            )
        role = message.get("role")
        if role not in _ROLES:
            raise ParamError(
                "messages", f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}"
            )
        content = message.get("content")
        if content is None and role != "assistant":
            raise ParamError("messages", f"messages[{i}].content is required for role {role!r}")
        if content is not None and not isinstance(content, str | list):
            raise ParamError(
                "messages", f"messages[{i}].content must be a string or a list of parts"
            )
    return [_flatten_content(m) for m in messages]


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """Join OpenAI text parts into one string: the chat templates we serve expect strings."""
    content = message.get("content")
    if not isinstance(content, list):
        return message if content is not None else {**message, "content": ""}
    texts = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise ParamError(
                "messages", "only text content parts ({type: text, text}) are supported"
            )
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


# Stand-ins for message content while the template renders (Unicode private-use characters):
# where they land in the rendered text is where the template put each content.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")
# Around a stand-in: a template that trims content (many do) trims this away too.
_PAD = " \t\n\t "


class HFTokenizer:
    """A transformers tokenizer with the checkpoint's chat template."""

    def __init__(self, tokenizer: Any, extra_eos: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos]))
        self.vocab_size: int = len(tokenizer)
        self._special_ids = set(tokenizer.all_special_ids)
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials = {str(t) for t in tokenizer.all_special_tokens}
        specials |= {str(t.content) for t in decoder.values() if getattr(t, "special", False)}
        specials.discard("")
        # Longest first, so that a special token that extends another one is found whole.
        self._special_text = (
            re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
            if specials
            else None
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_plain(self, text: str) -> list[int]:
        """`text` with special-token strings in it tokenized as ordinary text."""
        ids = self._tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return list(ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        content_special_tokens: bool = False,
    ) -> list[int]:
        checked = validate_messages(messages)
        if not getattr(self._tok, "chat_template", None):
            raise ParamError("messages", "this model's tokenizer has no chat template")
        pattern = self._special_text
        if content_special_tokens or pattern is None:
            return self._render_and_encode(checked, add_generation_prompt)
        if not any(pattern.search(m["content"]) for m in checked):
            # The usual case: nothing in the content could turn into a control token.
            return self._render_and_encode(checked, add_generation_prompt)
        return self._encode_content_as_text(checked, add_generation_prompt)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            text = self._tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja raises its own errors for template-level rejections
            raise ParamError("messages", f"the chat template rejected the messages: {exc}") from exc
        return str(text)

    def _render_and_encode(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool
    ) -> list[int]:
        # The template already wrote the special tokens (BOS included where it wants one).
        return self.encode(self._render(messages, add_generation_prompt), add_special_tokens=False)

    def _encode_content_as_text(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool
    ) -> list[int]:
        """Render with stand-ins for the contents, then tokenize the template's own text with
        its control tokens and each content as plain text, where the template placed it.

        A template may trim content (the stand-in's whitespace padding shows it); one that
        changes content otherwise cannot be followed, and the request is refused rather than
        let content text turn into control tokens.
        """
        stand_ins = [
            {**m, "content": f"{_PAD}{_MARK_OPEN}{i}{_MARK_CLOSE}{_PAD}"}
            for i, m in enumerate(messages)
        ]
        parts = _MARK.split(self._render(stand_ins, add_generation_prompt))
        # parts: template text, content index, template text, ..., template text
        texts = parts[0::2]
        pieces: list[tuple[str, bool]] = []  # (text, is content)
        for k, index in enumerate(parts[1::2]):
            content = messages[int(index)]["content"]
            before, after = texts[k], texts[k + 1]
            if before.endswith(_PAD):
                texts[k] = before.removesuffix(_PAD)
            else:
                content = content.lstrip()
            if after.startswith(_PAD):
                texts[k + 1] = after.removeprefix(_PAD)
            else:
                content = content.rstrip()
            pieces.append((content, True))
        ordered: list[tuple[str, bool]] = [(texts[0], False)]
        for k, piece in enumerate(pieces):
            ordered += [piece, (texts[k + 1], False)]
        if "".join(text for text, _ in ordered) != self._render(messages, add_generation_prompt):
            raise ParamError(
                "messages",
                "message content holds special-token text that this model's chat template "
                "would turn into control tokens; remove it (or start the server with "
                "--allow-special-tokens-in-content)",
            )
        ids: list[int] = []
        for text, is_content in ordered:
            if text:
                ids += self.encode_plain(text) if is_content else self.encode(text, False)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(
            self._tok.decode(
                list(ids),
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        )

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self._tok.convert_ids_to_tokens(list(ids))]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, for random-weight models that ship no tokenizer.

    Special ids (BOS, EOS) decode to nothing when skipped; every other id above 255 decodes
    to one printable ASCII character (`!`..`~`), so text from random weights stays readable.
    The chat template is ChatML written as plain bytes.
    """

    def __init__(
        self, vocab_size: int, bos_token_id: int | None, eos_token_ids: Sequence[int]
    ) -> None:
        if vocab_size < 256:
            raise ParamError(
                "tokenizer", f"the byte tokenizer needs a vocabulary of >= 256, got {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self._special = {i for i in (bos_token_id, *self.eos_token_ids) if i is not None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        content_special_tokens: bool = False,
    ) -> list[int]:
        # Content is written as bytes: no text of it ever becomes a special token id.
        checked = validate_messages(messages)
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in checked)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text, add_special_tokens=True)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for token_id in ids:
            if token_id < 256 and token_id not in self._special:
                out.append(token_id)
            elif token_id in self._special:
                if not skip_special_tokens:
                    out += f"<|special_{token_id}|>".encode()
            else:
                out.append(33 + token_id % 94)
        return out.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        tokens = []
        for token_id in ids:
            if token_id in self._special:
                tokens.append(f"<|special_{token_id}|>")
            elif token_id < 256:
                tokens.append(f"<0x{token_id:02X}>")
            else:
                tokens.append(chr(33 + token_id % 94))
        return tokens

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special


def load_tokenizer(config: EngineConfig) -> Tokenizer:
    """The tokenizer for `config.tokenizer`, or for `config.model` when that is unset."""
    from davit_engine.loader import RANDOM_PREFIX, read_model_config

    source = config.tokenizer or config.model
    if source == BYTE_TOKENIZER or source.startswith(RANDOM_PREFIX):
        model_config = read_model_config(config.model)
        return ByteTokenizer(
            model_config.vocab_size, model_config.bos_token_id, model_config.eos_token_ids
        )
    from transformers import AutoTokenizer

    path = Path(source)
    if not path.exists():
        raise ParamError("tokenizer", f"{source}: no such file or directory")
    try:
        if path.suffix == ".gguf":
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            return HFTokenizer(hf)
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            raise OSError(f"none of {', '.join(_TOKENIZER_FILES)} is present")
        hf = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ParamError(
            "tokenizer",
            f"{source}: no usable tokenizer ({exc}); pass --tokenizer DIR or --tokenizer byte",
        ) from exc
    return HFTokenizer(hf, _generation_eos(path))


def _generation_eos(directory: Path) -> list[int]:
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError) as exc:
        raise ParamError("tokenizer", f"{path}: cannot be read as JSON: {exc}") from exc
    return eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
