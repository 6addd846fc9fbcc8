"""The request bodies' own checks (no server): shapes this engine does not serve are refused
naming the field, and engine field names map to the names each body sent."""

from __future__ import annotations

from typing import Any

import pytest

from davit_engine.server.protocol import (
    MAX_CHOICES,
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
)
from davit_engine.types import ParamError

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(messages=[]), "messages"),
        (chat(messages=[*USER, {"role": "user", "content": [{"type": "text", "text": ""}]}]),
         "messages[1]"),
        (chat(n=0), "n"),
        (chat(n=MAX_CHOICES + 1), "n"),
        (chat(logit_bias={"1": 1}), "logit_bias"),
        (chat(tools=[{}]), "tools"),
        (chat(response_format={"type": "json_schema"}), "response_format"),
        (chat(top_logprobs=2), "top_logprobs"),
        (completion(prompt=[]), "prompt"),
        (completion(prompt=[""]), "prompt"),
        (completion(prompt=[[1], []]), "prompt[1]"),
        (completion(prompt=["a"] * (MAX_PROMPTS + 1)), "prompt"),
        (completion(prompt=["a", "b"], n=MAX_CHOICES // 2 + 1), "n"),
        (completion(echo=True), "echo"),
        (completion(suffix="!"), "suffix"),
    ],
)  # fmt: skip
def test_unserved_shapes_are_refused_by_name(
    body: ChatCompletionRequest | CompletionRequest, param: str
) -> None:
    with pytest.raises(ParamError) as err:
        body.check()
    assert err.value.param == param
    assert param.split("[")[0] in err.value.message


def test_served_shapes_pass() -> None:
    chat(n=2, logprobs=True, top_logprobs=3, response_format={"type": "text"}).check()
    completion(prompt=[[1, 2], [3]], n=MAX_CHOICES // 2).check()


def test_prompts_of_each_shape() -> None:
    assert completion(prompt="a").prompts() == ["a"]
    assert completion(prompt=[1, 2]).prompts() == [[1, 2]]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_refusals_name_the_field_the_client_sent() -> None:
    assert chat().client_param("prompt") == "messages"
    assert chat().client_param("max_tokens") == "max_tokens"
    assert chat(max_completion_tokens=5).client_param("max_tokens") == "max_completion_tokens"
    assert chat().client_param("logprobs") == "top_logprobs"
    assert chat().client_param("temperature") == "temperature"
    for name in ("prompt", "max_tokens", "logprobs"):
        assert completion().client_param(name) == name
