"""Request bodies to `SamplingParams`: defaults, limits and parameter names in one place."""

from __future__ import annotations

from davit_engine.server.errors import OpenAIError
from davit_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from davit_engine.types import ParamError, SamplingParams

# OpenAI's documented default for /v1/completions; chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Each choice is a separate engine request; more than this in one HTTP request is refused.
MAX_CHOICES = 128


def check_num_choices(num_prompts: int, n: int) -> None:
    """Raise OpenAIError(400) naming `n` unless 1 <= n and prompts * n <= MAX_CHOICES."""
    if n < 1:
        raise OpenAIError(400, f"'n' must be at least 1, got {n}", "n")
    if num_prompts * n > MAX_CHOICES:
        raise OpenAIError(
            400,
            f"'n' is too large: {num_prompts} prompt(s) x n={n} choices exceed {MAX_CHOICES}",
            "n",
        )


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    max_logprobs: int,
) -> SamplingParams:
    """Build and validate the sampling settings; raises OpenAIError(400) naming the field.

    The context check is the upstream one: prompt plus max_tokens must fit in max_model_len.
    """
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if num_prompt_tokens >= max_model_len:
        raise OpenAIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens, and the prompt "
            f"has {num_prompt_tokens}; shorten the prompt to at most {max_model_len - 1} tokens",
            prompt_param,
        )

    _refuse_unsupported(request)
    if isinstance(request, ChatCompletionRequest):
        max_tokens_param = (
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        )
        max_tokens = (
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens
        )
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        logprobs_param = "top_logprobs"
        default_max_tokens = max_model_len - num_prompt_tokens
    else:
        max_tokens_param = "max_tokens"
        max_tokens = request.max_tokens
        logprobs = request.logprobs
        logprobs_param = "logprobs"
        default_max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, max_model_len - num_prompt_tokens)
        if request.echo:
            raise OpenAIError(400, "'echo' is not supported", "echo")
        if request.suffix:
            raise OpenAIError(400, "'suffix' is not supported", "suffix")

    if max_tokens is None:
        max_tokens = default_max_tokens
    elif max_tokens >= 1 and num_prompt_tokens + max_tokens > max_model_len:
        raise OpenAIError(
            400,
            f"'{max_tokens_param}' is too large: {num_prompt_tokens} prompt tokens plus "
            f"{max_tokens} completion tokens exceed the maximum context length of "
            f"{max_model_len}; ask for at most {max_model_len - num_prompt_tokens}",
            max_tokens_param,
        )

    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        seed=request.seed,
        repetition_penalty=1.0
        if request.repetition_penalty is None
        else request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        stop=stop,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        min_tokens=request.min_tokens,
    )
    try:
        params.validate(max_logprobs=max_logprobs)
    except ParamError as exc:
        # SamplingParams names its own fields; report the name the client actually sent.
        param = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}.get(
            exc.param, exc.param
        )
        raise OpenAIError(400, exc.message.replace(exc.param, param, 1), param) from exc
    return params


def _refuse_unsupported(request: ChatCompletionRequest | CompletionRequest) -> None:
    """Features a client could rely on that this engine does not implement: refuse, by name."""
    if request.logit_bias:
        raise OpenAIError(400, "'logit_bias' is not supported by this engine", "logit_bias")
    if isinstance(request, ChatCompletionRequest):
        if request.tools:
            raise OpenAIError(
                400, "'tools' (tool calling) is not supported by this engine", "tools"
            )
        kind = (request.response_format or {}).get("type", "text")
        if kind != "text":
            raise OpenAIError(
                400,
                f"'response_format' of type {kind!r} is not supported; only 'text' is",
                "response_format",
            )
