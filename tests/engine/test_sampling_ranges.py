"""SamplingParams ranges: every number any runner could not represent is refused naming the
field, and the two documented mappings (tiny temperature, tiny top_p) hold."""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest

from davit_engine.types import (
    GREEDY_TEMPERATURE,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MIN_TOP_P,
    ParamError,
    SamplingParams,
)

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": INT32_MAX + 1}, "max_tokens"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"temperature": NAN}, "temperature"),
        ({"temperature": INF}, "temperature"),
        ({"temperature": -1e-300}, "temperature"),
        ({"temperature": 1e38}, "temperature"),
        ({"top_p": NAN}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -INF}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": INT32_MAX + 1}, "top_k"),
        ({"top_k": 10**40}, "top_k"),
        ({"min_p": NAN}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": NAN}, "repetition_penalty"),
        ({"repetition_penalty": INF}, "repetition_penalty"),
        ({"repetition_penalty": 1e-320}, "repetition_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e38}, "repetition_penalty"),
        ({"presence_penalty": NAN}, "presence_penalty"),
        ({"presence_penalty": -INF}, "presence_penalty"),
        ({"frequency_penalty": 1e308}, "frequency_penalty"),
        ({"seed": INT64_MAX + 1}, "seed"),
        ({"seed": INT64_MIN - 1}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 10**30}, "logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"stop_token_ids": (1, -5)}, "stop_token_ids"),
        ({"stop_token_ids": (INT32_MAX + 1,)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_out_of_range_values_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ParamError) as err:
        SamplingParams(**fields).validate()
    assert err.value.param == param
    assert param in err.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": INT32_MAX},
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"temperature": 1e-45},
        {"top_p": 5e-324},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": INT32_MAX},
        {"min_p": 1e-45},
        {"repetition_penalty": 0.01},
        {"repetition_penalty": 100.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"seed": INT64_MIN},
        {"seed": INT64_MAX},
        {"stop_token_ids": (0, INT32_MAX)},
    ],
)
def test_values_at_the_edges_pass(fields: dict[str, Any]) -> None:
    SamplingParams(**fields).validate()


def test_a_tiny_temperature_samples_greedily() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-45).is_greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).is_greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy
    assert SamplingParams(temperature=1.0, top_k=1).is_greedy


def test_a_tiny_top_p_is_raised_to_a_float32_safe_floor() -> None:
    assert SamplingParams(top_p=1e-300).top_p == MIN_TOP_P
    assert SamplingParams(top_p=0.5).top_p == 0.5
    assert SamplingParams(top_p=0.0).top_p == 0.0  # still refused by validate()
    # float32 keeps the floor above zero, so the top token always stays.
    import numpy as np

    assert np.float32(MIN_TOP_P) > 0


def test_param_errors_survive_pickling() -> None:
    error = pickle.loads(pickle.dumps(ParamError("top_k", "top_k must be ...")))
    assert (error.param, error.message) == ("top_k", "top_k must be ...")
