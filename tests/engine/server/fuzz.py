"""Generated request bodies for the fuzz tests: from the server's own OpenAPI schema, then
with hostile values swapped in, and raw bytes that are not JSON at all.

`body_texts(openapi, path)` is a hypothesis strategy of request body texts for `path`:
- bodies the schema admits (`from_schema`, for the JSON Schema subset FastAPI writes for
  pydantic models: objects, arrays, anyOf, enum/const, references), which already cover every
  field, every type the schema allows, integers of any size, extreme floats and arbitrary
  Unicode text;
- the same with some fields replaced by values a careless or hostile client sends: NaN and
  Infinity literals, integers past int64, float32 extremes, lone surrogates, wrong types,
  empty and huge strings, deep nesting;
- bytes that are not valid JSON or not valid UTF-8.
Numbers that only make the server work longer (n, max_tokens, ...) are kept small in the
admitted bodies so that volume goes to breadth, not to long generations, and `model` is left
to the server's default (a random name stops at 404 before anything else is checked); the
hostile replacements still reach those fields.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import hypothesis.strategies as st

# Fields whose admitted values only cost time: wrapped into a small range in admitted bodies.
_COSTLY = {"n": 3, "max_tokens": 6, "max_completion_tokens": 6, "min_tokens": 3}

HOSTILE: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    10**30,
    -(10**30),
    2**31,
    2**63,
    -(2**63) - 1,
    -1,
    0,
    1e-45,
    5e-324,
    1e38,
    -1e308,
    "\ud800",
    "a\udfffb",
    "",
    "x" * 5000,
    None,
    True,
    [],
    {},
    [[[[[[[[[[1]]]]]]]]]],
    {"\ud800": 1},
    ["\udc00"],
    [10**20, -5],
]
RAW = [
    b"",
    b"{",
    b'{"prompt": "hi", ',
    b"\xff\xfe{}",
    b"[1, 2]",
    b'{"prompt": "caf\xe9"}',
    b"null",
    b'"just a string"',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
]


def _request_schema(openapi: dict[str, Any], path: str) -> dict[str, Any]:
    schema: dict[str, Any] = openapi["paths"][path]["post"]["requestBody"]["content"][
        "application/json"
    ]["schema"]
    return schema


_JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON_VALUES = st.recursive(
    _JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values `schema` admits (the subset of JSON Schema that FastAPI writes)."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        return st.deferred(lambda: from_schema(target, defs))
    if "anyOf" in schema:
        return st.one_of([from_schema(option, defs) for option in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties")
        if not properties:
            return st.dictionaries(st.text(max_size=10), JSON_VALUES, max_size=3)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: from_schema(v, defs) for k, v in properties.items() if k in required},
            optional={k: from_schema(v, defs) for k, v in properties.items() if k not in required},
        )
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs), max_size=4)
    simple: dict[str, st.SearchStrategy[Any]] = {
        "string": st.text(max_size=40),
        "integer": st.integers(),
        "number": st.floats(allow_nan=False, allow_infinity=False) | st.integers(-5, 5),
        "boolean": st.booleans(),
        "null": st.none(),
    }
    return simple.get(str(kind), JSON_VALUES)


def _small(body: Any) -> Any:
    if isinstance(body, dict):
        if "model" in body:
            body["model"] = None  # a random name is a 404 before anything else is looked at
        if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 4  # chat's default is the rest of the context
        for key, limit in _COSTLY.items():
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                body[key] = 1 + value % limit
    return body


def _encode(body: Any) -> bytes:
    # ensure_ascii writes lone surrogates as \\udXXX escapes; allow_nan writes NaN/Infinity.
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


@st.composite
def _mutated(draw: st.DrawFn, bodies: st.SearchStrategy[Any]) -> Any:
    body = draw(bodies)
    if not isinstance(body, dict) or not body:
        return body
    keys = sorted(body)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(keys))
        value = draw(st.sampled_from(HOSTILE))
        if isinstance(body[key], list) and body[key] and draw(st.booleans()):
            body[key] = [*body[key][:-1], value]  # inside a list: prompts, stop, messages
        elif isinstance(body[key], list) and body[key] and isinstance(body[key][0], dict):
            first = dict(body[key][0])
            inner = draw(st.sampled_from(sorted(first) or ["content"]))
            first[inner] = value
            body[key] = [first, *body[key][1:]]
        else:
            body[key] = value
    return body


def body_texts(openapi: dict[str, Any], path: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, body bytes) for POST `path`; kind is schema, hostile or raw."""
    defs = openapi["components"]["schemas"]
    admitted = from_schema(_request_schema(openapi, path), defs).map(_small)
    return st.one_of(
        admitted.map(lambda b: ("schema", _encode(b))),
        _mutated(admitted).map(lambda b: ("hostile", _encode(b))),
        st.sampled_from(RAW).map(lambda b: ("raw", b)),
        st.binary(max_size=64).map(lambda b: ("raw", b)),
    )


class Tally:
    """What a fuzz run sent and got back, for the test's report."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()

    def record(self, kind: str, status: int) -> None:
        self.sent[kind] += 1
        self.statuses[status] += 1

    def __str__(self) -> str:
        return f"sent {dict(self.sent)}, answered {dict(sorted(self.statuses.items()))}"
