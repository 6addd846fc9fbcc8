"""Property-based fuzzing of the whole protocol schema against the real app and core process
(fake model, for volume): every generated body gets a non-5xx answer, no stream carries an
internal error, and afterwards the server still serves exactly what it should."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from .conftest import FakeServer, serve_fake
from .fake_core import SCRIPT
from .fuzz import Tally, body_texts

PATHS = ("/v1/completions", "/v1/chat/completions")
EXAMPLES = 500  # per route


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    with serve_fake(step_s=0.0005, max_num_seqs=32) as server:
        yield server


@pytest.fixture(scope="module")
def openapi(server: FakeServer) -> dict[str, Any]:
    schema: dict[str, Any] = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    return schema


def check_answer(response: httpx.Response, body: bytes) -> None:
    assert response.status_code < 500, (body[:300], response.text[:500])
    # A stream that started fine must not end in an internal error either.
    assert "InternalServerError" not in response.text, (body[:300], response.text[-500:])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["code"] == response.status_code


@pytest.mark.parametrize("path", PATHS)
def test_generated_bodies_never_get_a_5xx(
    server: FakeServer, openapi: dict[str, Any], path: str
) -> None:
    tally = Tally()
    http = httpx.Client(base_url=server.base_url, timeout=60)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body_texts(openapi, path))
    def one(case: tuple[str, bytes]) -> None:
        kind, body = case
        response = http.post(path, content=body, headers={"content-type": "application/json"})
        tally.record(kind, response.status_code)
        check_answer(response, body)

    with http:
        one()
        print(f"{path}: {tally}")
        assert sum(tally.sent.values()) >= EXAMPLES
        assert tally.statuses[200] > 0 and tally.statuses[400] > 0, tally
        # Still serving, and nothing accepted was lost or left behind.
        reply = http.post(path.replace("chat/", ""), json={"prompt": "hi", "max_tokens": 5})
        assert reply.json()["choices"][0]["text"] == SCRIPT[:5]
        assert http.get("/health").status_code == 200
    stats = server.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert server.state.num_in_flight == 0
