"""Canary analysis input: the engine's own /metrics text, parsed and summed across pods."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from davit_engine.server.metrics import ServerMetrics
from davit_operator.rollout.metrics import Sample, parse_metrics, read_pods


def engine_text(ok: int, bad: int, full: int, ttfts: list[float]) -> str:
    """Metrics as the engine renders them after serving these answers."""
    m = ServerMetrics("smol")
    for _ in range(ok):
        m.http_response("/v1/completions", "POST", 200)
        m.request_finished("length")
    for _ in range(bad):
        m.http_response("/v1/chat/completions", "POST", 400)
    for _ in range(full):
        m.http_response("/v1/completions", "POST", 429)
    for t in ttfts:
        m.time_to_first_token.observe(t)
    return m.render().decode()


def test_error_ratio_counts_failures_but_not_admission_control() -> None:
    sample = parse_metrics(engine_text(ok=6, bad=3, full=1, ttfts=[]))
    assert sample.requests == 10 and sample.errors == 3 and sample.successes == 6
    assert sample.error_ratio == pytest.approx(0.3)


def test_p95_of_the_merged_histogram_is_a_bucket_bound() -> None:
    a = parse_metrics(engine_text(1, 0, 0, [0.003] * 18))
    b = parse_metrics(engine_text(1, 0, 0, [0.3, 3.0]))
    total = Sample()
    total.add(a)
    total.add(b)
    # 20 observations; the 19th (rank 19 = 0.95 * 20) lies in the (0.25, 0.5] bucket.
    assert total.ttft_quantile(0.95) == 0.5
    assert total.ttft_quantile(0.5) == 0.005
    assert Sample().ttft_quantile(0.95) is None
    over = parse_metrics(engine_text(0, 0, 0, [5000.0]))
    assert math.isinf(over.ttft_quantile(0.95) or 0.0)


@pytest.fixture
def one_engine() -> Iterator[list[str]]:
    texts = {"127.0.0.1": engine_text(4, 1, 0, [0.02] * 5)}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = texts[self.server.server_address[0]].encode()  # type: ignore[index]
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield [str(server.server_address[1])]
    finally:
        server.shutdown()
        server.server_close()


def test_read_pods_sums_answers_and_names_the_unreachable(one_engine: list[str]) -> None:
    port = int(one_engine[0])
    # 127.0.0.2 listens nowhere: refused, reported, not counted.
    reading = asyncio.run(read_pods(["127.0.0.1", "127.0.0.2"], port, timeout_s=2.0))
    assert reading.pods_read == 1 and reading.unreachable == ("127.0.0.2",)
    assert reading.sample.requests == 5 and reading.sample.errors == 1
