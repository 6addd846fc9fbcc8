"""`http_requests_total`: the per-status counter rollout analysis reads from every engine."""

from __future__ import annotations

from .conftest import MODEL, FakeServer


def _count(text: str, handler: str, status: str) -> float:
    for line in text.splitlines():
        if (
            line.startswith("http_requests_total{")
            and f'handler="{handler}"' in line
            and f'status="{status}"' in line
            and 'method="POST"' in line
        ):
            return float(line.split()[-1])
    return 0.0


def test_generation_answers_are_counted_by_status(fake_server: FakeServer) -> None:
    with fake_server.http() as http:
        before = http.get("/metrics").text
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).is_success
        assert (
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1}).status_code == 400
        )
        bad_model = {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}
        assert http.post("/v1/chat/completions", json=bad_model).status_code == 404
        streamed = {"prompt": "hi", "max_tokens": 2, "stream": True}
        with http.stream("POST", "/v1/completions", json=streamed) as response:
            assert response.status_code == 200
            response.read()
        http.get("/v1/models")
        http.get("/no/such/path/123")
        after = http.get("/metrics").text
    assert _count(after, "/v1/completions", "200") - _count(before, "/v1/completions", "200") == 2
    assert _count(after, "/v1/completions", "400") - _count(before, "/v1/completions", "400") == 1
    chat_404 = _count(after, "/v1/chat/completions", "404")
    assert chat_404 - _count(before, "/v1/chat/completions", "404") == 1
    assert 'handler="/v1/models",method="GET",status="200"' in after
    # Paths that are no route share one label: clients cannot grow the label set.
    assert "/no/such/path" not in after
    assert 'handler="none",method="GET",status="404"' in after
    assert f'model_name="{MODEL}"' in after
