"""The only module that talks to the API server on the operator's behalf (kopf's own watches,
status patches and events aside).

Children are written with server-side apply (`application/apply-patch+yaml`, field manager
`davit-operator`, force) so the operator owns exactly the fields it sets. `needs_apply` decides
whether a write is needed at all: a child whose desired-state hash annotation matches and whose
owned fields still hold their desired values is left alone, so an unchanged spec makes no write.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import httpx
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.utils.quantity import parse_quantity

from davit_operator.api.identity import FIELD_MANAGER
from davit_operator.builders.digest import DESIRED_HASH_ANNOTATION

# kind -> (API path prefix, plural) for the kinds the operator manages.
KIND_PATHS: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Pod": ("/api/v1", "pods"),
    "Job": ("/apis/batch/v1", "jobs"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "HTTPRoute": ("/apis/gateway.networking.k8s.io/v1", "httproutes"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
}


class KubeError(RuntimeError):
    """The API server refused a request; `status` is the HTTP code (0 for transport errors)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def is_temporary(self) -> bool:
        """Worth retrying unchanged: transport errors, throttling, conflicts, server errors."""
        return self.status in (0, 409, 429) or self.status >= 500


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have:
        return True
    # The API server canonicalises quantities ("0.5" -> "500m", "1024Mi" -> "1Gi").
    if isinstance(want, str | int) and isinstance(have, str | int):
        try:
            return bool(parse_quantity(want) == parse_quantity(have))
        except (ValueError, InvalidOperation, TypeError):
            return False
    if isinstance(want, float) and isinstance(have, int | float):
        return Decimal(str(want)) == Decimal(str(have))
    return False


def is_subset(want: Any, have: Any) -> bool:
    """True when every field of `want` holds the same value in `have`; extra fields in `have`
    (defaults the API server filled in, fields other managers own) are ignored. Lists must have
    the same length and match element by element."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return False
        return all(is_subset(value, have.get(key)) for key, value in want.items())
    if isinstance(want, list):
        if not isinstance(have, list) or len(want) != len(have):
            return False
        return all(is_subset(w, h) for w, h in zip(want, have, strict=True))
    return _same_scalar(want, have)


def needs_apply(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """Whether `desired` (already carrying its hash annotation) must be applied over `live`.

    A changed hash means the operator's intent changed (which may remove fields: only an apply
    does that); an unchanged hash with a differing owned field means someone else changed it.
    """
    if live is None:
        return True
    annotations = (live.get("metadata") or {}).get("annotations") or {}
    wanted = desired["metadata"]["annotations"][DESIRED_HASH_ANNOTATION]
    if annotations.get(DESIRED_HASH_ANNOTATION) != wanted:
        return True
    return not is_subset(
        {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}, live
    )


def _object_path(kind: str, namespace: str, name: str | None = None) -> str:
    prefix, plural = KIND_PATHS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


@dataclass(frozen=True)
class Credentials:
    server: str
    verify: ssl.SSLContext | bool
    cert: tuple[str, str] | None
    authorization: str | None


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    """Credentials from a kubeconfig (the argument or $KUBECONFIG), else the in-cluster service
    account, else ~/.kube/config."""
    cfg = k8s_client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        k8s_config.load_kube_config(config_file=path, client_configuration=cfg)
    else:
        try:
            k8s_config.load_incluster_config(client_configuration=cfg)
        except k8s_config.ConfigException:
            k8s_config.load_kube_config(client_configuration=cfg)
    verify: ssl.SSLContext | bool = True
    if cfg.ssl_ca_cert:
        verify = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
    elif not cfg.verify_ssl:
        verify = False
    cert = (cfg.cert_file, cfg.key_file) if cfg.cert_file and cfg.key_file else None
    if isinstance(verify, ssl.SSLContext) and cert:
        verify.load_cert_chain(*cert)
    if cfg.refresh_api_key_hook is not None:
        cfg.refresh_api_key_hook(cfg)
    token = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
    if token and not token.lower().startswith("bearer "):
        token = f"Bearer {token}"
    return Credentials(server=cfg.host, verify=verify, cert=cert, authorization=token)


class KubeClient:
    """Async API-server client for the operator's children. One per operator process."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        timeout: float = 30.0,
        reload: Callable[[], Credentials] | None = None,
    ) -> None:
        """`reload` re-reads the credentials after a 401 (rotated service-account tokens)."""
        self._reload = reload
        headers = {"Accept": "application/json", "User-Agent": f"{FIELD_MANAGER}/0.1.0"}
        if credentials.authorization:
            headers["Authorization"] = credentials.authorization
        self._http = httpx.AsyncClient(
            base_url=credentials.server,
            verify=credentials.verify,
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=16),
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
            if response.status_code == 401 and self._reload is not None:
                fresh = self._reload()
                if fresh.authorization:
                    self._http.headers["Authorization"] = fresh.authorization
                    response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise KubeError(0, f"{method} {path}: {exc!r}") from exc
        return response

    @staticmethod
    def _fail(method: str, path: str, response: httpx.Response) -> KubeError:
        try:
            message = response.json().get("message", response.text)
        except ValueError:
            message = response.text
        return KubeError(response.status_code, f"{method} {path}: {message}")

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` (force: the operator owns these fields); returns the live
        object."""
        meta = obj["metadata"]
        path = _object_path(obj["kind"], meta["namespace"], meta["name"])
        response = await self._request(
            "PATCH",
            path,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        if response.status_code >= 300:
            raise self._fail("PATCH", path, response)
        live: dict[str, Any] = response.json()
        return live

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The live object, or None when it does not exist."""
        path = _object_path(kind, namespace, name)
        response = await self._request("GET", path)
        if response.status_code == 404:
            return None
        if response.status_code >= 300:
            raise self._fail("GET", path, response)
        live: dict[str, Any] = response.json()
        return live

    async def serves(self, group_version: str, plural: str) -> bool:
        """Whether the API server serves `plural` in `group_version` (an installed CRD)."""
        path = f"/apis/{group_version}"
        response = await self._request("GET", path)
        if response.status_code == 404:
            return False
        if response.status_code >= 300:
            raise self._fail("GET", path, response)
        return any(r.get("name") == plural for r in response.json().get("resources") or [])

    async def merge_patch(
        self, kind: str, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of an object the operator does not own (for example a user's
        HTTPRoute): only the fields in `body` change."""
        path = _object_path(kind, namespace, name)
        response = await self._request(
            "PATCH",
            path,
            content=json.dumps(body),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        if response.status_code >= 300:
            raise self._fail("PATCH", path, response)
        live: dict[str, Any] = response.json()
        return live

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Objects of `kind` in `namespace` matching the label selector."""
        path = _object_path(kind, namespace)
        response = await self._request("GET", path, params={"labelSelector": label_selector})
        if response.status_code >= 300:
            raise self._fail("GET", path, response)
        items: list[dict[str, Any]] = response.json().get("items") or []
        return items

    async def delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete the object with this uid (a same-named replacement is left alone)."""
        path = _object_path(kind, namespace, name)
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": {"uid": uid},
            "propagationPolicy": "Background",
        }
        response = await self._request(
            "DELETE", path, content=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        if response.status_code in (404, 409):
            return
        if response.status_code >= 300:
            raise self._fail("DELETE", path, response)
