"""OpenAI protocol models: one pydantic model per request and response body.

Requests are strict (a string where a number belongs is a 400 naming the field, not a silent
conversion; `NaN` and `Infinity` are refused where a number belongs; text anywhere in the body,
unknown fields and keys included, must be valid Unicode: no lone surrogate escapes) and ignore
unknown fields, as OpenAI clients add new ones over time. What a request
body may hold is checked here, in one place: its types by pydantic, and by each request's
`check()` the shapes this engine does not serve (empty prompts or messages, too many choices,
fields it does not implement). Conversion to the engine's internal types, with the sampling
parameters' own validation, happens in `sampling.py`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from davit_engine.types import ParamError

# Each choice is a separate engine request; more than this in one HTTP request is refused.
MAX_CHOICES = 128
# More prompts than this in one request are refused: each becomes a separate engine request.
MAX_PROMPTS = 64


# A UTF-16 surrogate code point in a decoded string: JSON's \ud800-style escapes let a body
# carry one without a pair, and such text cannot be encoded (tokenizers and responses fail).
_SURROGATE = re.compile("[\ud800-\udfff]")
LONE_SURROGATE = "lone_surrogate"


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string or key holding a surrogate."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            key_text = str(key)
            # The path goes back in the error body: a surrogate in it is written escaped.
            name = key_text.encode("utf-8", "backslashreplace").decode("utf-8")
            child = f"{path}.{name}" if path else name
            if _SURROGATE.search(key_text):
                return child
            found = find_lone_surrogate(item, child)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = find_lone_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _Body(_Request):
    """A whole request body: its raw JSON is checked for lone surrogates before validation."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = find_lone_surrogate(data)
        if path is not None:
            raise PydanticCustomError(
                LONE_SURROGATE,
                "'{param}' is not valid Unicode: it holds a lone UTF-16 surrogate escape",
                {"param": path or "body"},
            )
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class _GenerationRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI plus upstream extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # Accepted so that using them is an explicit 400, not silently ignored (see sampling.py).
    logit_bias: dict[str, Any] | None = None
    # Extras, named as the upstream engine names them.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def check(self) -> None:
        """Refuse what the body's types allow but this engine does not serve; ParamError names
        the field as the client sent it."""
        if self.logit_bias:
            raise ParamError("logit_bias", "'logit_bias' is not supported by this engine")

    def client_param(self, param: str) -> str:
        """The field this body sent for `param`, a field of `SamplingParams` or of the core's
        request (`prompt`); a refusal names the field the client knows."""
        return param

    def _check_num_choices(self, num_prompts: int) -> None:
        """1 <= n, and at most MAX_CHOICES choices (prompts times n) in all."""
        if self.n < 1:
            raise ParamError("n", f"'n' must be at least 1, got {self.n}")
        if num_prompts * self.n > MAX_CHOICES:
            raise ParamError(
                "n",
                f"'n' is too large: {num_prompts} prompt(s) x n={self.n} choices exceed "
                f"{MAX_CHOICES}",
            )


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as one string (text parts joined, none as empty)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Accepted so that using them is an explicit 400, not silently ignored (see check()).
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        if not self.messages:
            raise ParamError("messages", "'messages' must contain at least one message")
        for i, message in enumerate(self.messages):
            if message.role == "user" and not message.text:
                raise ParamError(f"messages[{i}]", f"'messages[{i}].content' must not be empty")
        self._check_num_choices(1)
        super().check()
        if self.tools:
            raise ParamError("tools", "'tools' (tool calling) is not supported by this engine")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ParamError(
                "response_format",
                f"'response_format' of type {kind!r} is not supported; only 'text' is",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "'top_logprobs' needs 'logprobs': true")

    def client_param(self, param: str) -> str:
        if param == "prompt":
            return "messages"
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if param == "logprobs":
            return "top_logprobs"
        return param


class CompletionRequest(_GenerationRequest):
    # A string, or token ids; a list of one of those is accepted when it holds one prompt.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt this body holds: a string or token ids, or a list of either."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            # The strict model admits only lists of one kind, so the first item tells.
            return [list(prompt)]  # token ids
        return list(prompt)  # type: ignore[arg-type]  # strings or token-id lists

    def check(self) -> None:
        prompts = self.prompts()
        if not prompts:
            raise ParamError("prompt", "'prompt' must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise ParamError(
                "prompt",
                f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} are allowed",
            )
        for i, prompt in enumerate(prompts):
            if not prompt:
                param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise ParamError(param, f"'{param}' must not be empty")
        self._check_num_choices(len(prompts))
        super().check()
        if self.echo:
            raise ParamError("echo", "'echo' is not supported")
        if self.suffix:
            raise ParamError("suffix", "'suffix' is not supported")


# --- responses --------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "davit"
    root: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: Annotated[int | str | None, Field()] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, type_: str, param: str | None, code: int | str | None) -> Any:
    """The JSON body OpenAI clients parse into an APIError."""
    return ErrorResponse(
        error=ErrorInfo(message=message, type=type_, param=param, code=code)
    ).model_dump()
