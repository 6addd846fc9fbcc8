"""Canary analysis input: the engines' own Prometheus metrics, read from each pod directly.

No Prometheus server and no mesh are assumed: the operator lists the canary's pods and GETs
`http://POD_IP:PORT/metrics` from each, as a scrape would. Counters are cumulative since each
engine started, and canary pods start with the canary, so summing them gives the canary's whole
history. The error ratio counts generation answers other than 2xx and 429 (a full queue answers
429 by design; it says nothing about the revision) in `http_requests_total`; the p95 time to
first token is read from the merged `vllm:time_to_first_token_seconds` histogram.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"


@dataclass
class Sample:
    """What one or more engines reported, summed."""

    requests: float = 0.0
    errors: float = 0.0
    successes: float = 0.0
    ttft_buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative

    def add(self, other: Sample) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.successes += other.successes
        for bound, count in other.ttft_buckets.items():
            self.ttft_buckets[bound] = self.ttft_buckets.get(bound, 0.0) + count

    @property
    def error_ratio(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    def ttft_quantile(self, q: float) -> float | None:
        """The upper bound of the first bucket holding the q-quantile (a conservative
        estimate: the true value is at most this); None without observations, inf when the
        quantile lies beyond the largest finite bound."""
        if not self.ttft_buckets:
            return None
        bounds = sorted(self.ttft_buckets)
        total = self.ttft_buckets[bounds[-1]]
        if total <= 0:
            return None
        rank = q * total
        for bound in bounds:
            if self.ttft_buckets[bound] >= rank:
                return bound
        return math.inf


def _is_error(status: str) -> bool:
    """Grouped ("5xx") or exact ("503") status labels; 429 is admission control, not failure."""
    if status == "429":
        return False
    return not status.startswith("2")


def parse_metrics(text: str) -> Sample:
    """Sum the series the analysis needs from one engine's /metrics text."""
    sample = Sample()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "http_requests_total" and s.labels.get("handler") in GENERATION_ROUTES:
                sample.requests += s.value
                if _is_error(s.labels.get("status", "")):
                    sample.errors += s.value
            elif s.name == "vllm:request_success_total":
                sample.successes += s.value
            elif s.name == f"{TTFT_HISTOGRAM}_bucket":
                bound = float(s.labels["le"])
                sample.ttft_buckets[bound] = sample.ttft_buckets.get(bound, 0.0) + s.value
    return sample


@dataclass(frozen=True)
class Reading:
    """The summed sample of the pods that answered, and the addresses that did not."""

    sample: Sample
    pods_read: int
    unreachable: tuple[str, ...]


async def read_pods(
    addresses: list[str], port: int, path: str = "/metrics", timeout_s: float = 3.0
) -> Reading:
    """GET every pod's metrics concurrently and sum them."""
    total = Sample()
    failed: list[str] = []
    read = 0
    async with httpx.AsyncClient(timeout=timeout_s) as http:

        async def one(address: str) -> Sample | None:
            try:
                response = await http.get(f"http://{address}:{port}{path}")
            except httpx.HTTPError:
                return None
            if response.status_code != 200:
                return None
            return parse_metrics(response.text)

        results = await asyncio.gather(*(one(a) for a in addresses))
    for address, result in zip(addresses, results, strict=True):
        if result is None:
            failed.append(address)
        else:
            total.add(result)
            read += 1
    return Reading(sample=total, pods_read=read, unreachable=tuple(failed))
