"""Service stand-in and continuous load for the rollout tests.

The local control plane has no endpoints and no kube-proxy (loopback addresses are refused in
Endpoints), so `ServiceEndpoints` does their job for one Service: it reads the Service's own
selector and routes to the pods it selects that are Ready and not terminating, as an
EndpointSlice's `ready` addresses would. `Load` sends completions through it from several
threads and sorts every answer:

- ok: 200 with a completion;
- not admitted: the connection was refused, or the engine answered 503 (draining, or not loaded)
  or 429 (queue full) before taking the request: a client retries these, nothing was lost;
- failed: everything else (a 4xx/5xx after admission, a connection cut mid-request, a timeout).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client as k8s
from kubernetes import config as k8s_config

NOT_ADMITTED_STATUS = (429, 503)


class ServiceEndpoints:
    """The ready, non-terminating pods a Service selects, refreshed in the background."""

    def __init__(self, kubeconfig: Path, namespace: str, service: str, port: int) -> None:
        self.api = k8s_config.new_client_from_config(str(kubeconfig))
        # Untyped on purpose: pod fields read here are always set for a scheduled pod.
        self.core: Any = k8s.CoreV1Api(self.api)
        self.namespace, self.service, self.port = namespace, service, port
        self.addresses: list[tuple[str, dict[str, str]]] = []  # (pod IP, pod labels)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._rr = itertools.count()

    def start(self) -> ServiceEndpoints:
        self._refresh()
        self._thread.start()
        return self

    def _refresh(self) -> None:
        selector = self.core.read_namespaced_service(self.service, self.namespace).spec.selector
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=label_selector).items
        ready = []
        for pod in pods:
            if pod.metadata.deletion_timestamp is not None or not pod.status.pod_ip:
                continue
            conditions = pod.status.conditions or []
            if any(c.type == "Ready" and c.status == "True" for c in conditions):
                ready.append((pod.status.pod_ip, dict(pod.metadata.labels or {})))
        self.addresses = sorted(ready)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._refresh()
            except k8s.ApiException:
                continue

    def pick(self) -> tuple[str, dict[str, str]] | None:
        current = self.addresses
        if not current:
            return None
        return current[next(self._rr) % len(current)]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.api.close()


@dataclass
class Tally:
    ok: int = 0
    not_admitted: int = 0
    failed: list[str] = field(default_factory=list)
    by_track: Counter[str] = field(default_factory=Counter)  # ok answers per TRACK/HASH
    statuses: Counter[int] = field(default_factory=Counter)


class Load:
    """`workers` threads sending completions through `endpoints` until stopped."""

    def __init__(
        self,
        endpoints: ServiceEndpoints,
        model: str,
        prompt: str,
        max_tokens: int = 6,
        workers: int = 3,
        timeout_s: float = 60.0,
    ) -> None:
        self.endpoints = endpoints
        self.body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        self.workers, self.timeout_s = workers, timeout_s
        self.tally = Tally()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(workers)]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def _worker(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as http:
            while not self._stop.is_set():
                target = self.endpoints.pick()
                if target is None:
                    time.sleep(0.1)
                    continue
                ip, labels = target
                # Which replica set answered: track and pod-template hash tell revisions apart.
                track = labels.get("serving.davit.dev/track", "stable")
                track = f"{track}/{labels.get('pod-template-hash', '?')}"
                url = f"http://{ip}:{self.endpoints.port}/v1/completions"
                try:
                    response = http.post(url, json=self.body)
                except httpx.ConnectError:
                    self._count(not_admitted=True)
                    time.sleep(0.05)
                    continue
                except httpx.HTTPError as exc:
                    self._count(failed=f"{ip} ({track}): {type(exc).__name__}: {exc}")
                    continue
                self._count(status=response.status_code)
                if response.status_code in NOT_ADMITTED_STATUS:
                    self._count(not_admitted=True)
                    time.sleep(0.05)
                elif response.status_code == 200 and response.json().get("choices"):
                    self._count(ok_track=track)
                else:
                    self._count(
                        failed=f"{ip} ({track}): {response.status_code} {response.text[:200]}"
                    )

    def _count(
        self,
        *,
        not_admitted: bool = False,
        failed: str | None = None,
        ok_track: str | None = None,
        status: int | None = None,
    ) -> None:
        with self._lock:
            t = self.tally
            if not_admitted:
                t.not_admitted += 1
            if failed is not None:
                t.failed.append(failed)
            if ok_track is not None:
                t.ok += 1
                t.by_track[ok_track] += 1
            if status is not None:
                t.statuses[status] += 1

    def stop(self) -> Tally:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 5)
        return self.tally
