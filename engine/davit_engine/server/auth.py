"""The API key: `--api-key` or the `VLLM_API_KEY` environment variable, as upstream names them.

With a key set, every route but the probes and the scrape (`/health`, `/ready`, `/metrics`)
needs `Authorization: Bearer <key>`; without it the answer is 401 with an OpenAI error body,
which OpenAI clients raise as AuthenticationError. Keys are compared in constant time, so the
answer's timing does not tell how much of a guess was right.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from davit_engine.server.errors import error_response

API_KEY_ENV = "VLLM_API_KEY"
# Kubernetes probes and Prometheus scrape these without credentials.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class APIKeyMiddleware:
    """ASGI middleware answering 401 to requests without the bearer key (see the module)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        message = (
            "a valid API key is required: send it as 'Authorization: Bearer <key>'"
            if given
            else "this server requires an API key: send it as 'Authorization: Bearer <key>'"
        )
        response = error_response(401, message, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
