"""Checked request bodies to `SamplingParams`: defaults, the context limit, and the one
validation of sampling parameters (`SamplingParams.validate`), reported under the names the
client sent."""

from __future__ import annotations

from davit_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from davit_engine.types import ParamError, SamplingParams

# OpenAI's documented default for /v1/completions; chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    max_logprobs: int,
) -> SamplingParams:
    """Build and validate the sampling settings; raises ParamError naming the client's field.

    The context check is the upstream one: prompt plus max_tokens must fit in max_model_len.
    """
    if num_prompt_tokens >= max_model_len:
        raise ParamError(
            request.client_param("prompt"),
            f"this model's maximum context length is {max_model_len} tokens, and the prompt "
            f"has {num_prompt_tokens}; shorten the prompt to at most {max_model_len - 1} tokens",
        )
    if isinstance(request, ChatCompletionRequest):
        max_tokens = (
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens
        )
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        default_max_tokens = max_model_len - num_prompt_tokens
    else:
        max_tokens = request.max_tokens
        logprobs = request.logprobs
        default_max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, max_model_len - num_prompt_tokens)

    if max_tokens is None:
        max_tokens = default_max_tokens
    elif max_tokens >= 1 and num_prompt_tokens + max_tokens > max_model_len:
        param = request.client_param("max_tokens")
        raise ParamError(
            param,
            f"'{param}' is too large: {num_prompt_tokens} prompt tokens plus "
            f"{max_tokens} completion tokens exceed the maximum context length of "
            f"{max_model_len}; ask for at most {max_model_len - num_prompt_tokens}",
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
        param = request.client_param(exc.param)
        raise ParamError(param, exc.message.replace(exc.param, param, 1)) from exc
    return params
