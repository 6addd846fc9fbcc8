"""OpenAI-style errors: the exception handlers raise through and the handlers that render them.

Every error leaves as `{"error": {"message", "type", "param", "code"}}` with a status code an
OpenAI client maps to the right exception class; `param` names the offending field.

Server-side errors (5xx) never show internals: their message is cut to its first line and
file system paths in it are replaced (`public_message`), and an unexpected exception answers
500 with an error id that the log line carrying the traceback also names.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from davit_engine.server.protocol import LONE_SURROGATE, error_body
from davit_engine.types import ParamError

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# Pydantic names the member of a union that failed (`str`, `list[int]`, ...) inside `loc`; those
# tags mean nothing to an API user, so they are dropped from `param`.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


class OpenAIError(Exception):
    """An error to answer with an OpenAI error body. `headers` go on the response."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.headers = headers or {}


# An absolute path (two components at least) where a word starts: `/usr/lib/x.py`.
_PATH = re.compile(r"(?<![\w.~/-])/(?:[\w.@+~-]+/)+[\w.@+~-]*")
_MAX_PUBLIC_MESSAGE = 500


def public_message(message: str) -> str:
    """`message` fit for a client: its first line, without file system paths."""
    first = message.strip().split("\n", 1)[0]
    first = _PATH.sub("<path>", first)
    if len(first) > _MAX_PUBLIC_MESSAGE:
        first = first[: _MAX_PUBLIC_MESSAGE - 3] + "..."
    return first


def error_payload(status_code: int, message: str, param: str | None = None) -> Any:
    """The OpenAI error body for `status_code` (also sent as an SSE event mid-stream)."""
    type_ = _ERROR_TYPES.get(status_code, "BadRequestError" if status_code < 500 else "APIError")
    if status_code >= 500:
        message = public_message(message)
    return error_body(message, type_, param, status_code)


def error_response(
    status_code: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        error_payload(status_code, message, param), status_code=status_code, headers=headers
    )


def param_from_loc(loc: Sequence[int | str]) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        if item in _UNION_TAGS or "[" in item or item.startswith("function-"):
            continue
        parts.append(item)
    return ".".join(parts) or None


def validation_message(error: dict[str, Any]) -> tuple[str, str | None]:
    """A readable message and the param for one pydantic/FastAPI validation error."""
    loc = tuple(error.get("loc", ()))
    kind = error.get("type", "")
    if kind == LONE_SURROGATE:
        return str(error.get("msg", "")), error.get("ctx", {}).get("param")
    if kind == "json_invalid":
        detail = error.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    param = param_from_loc(loc)
    if param is None:
        if kind == "missing":
            return "the request needs a JSON body", None
        return f"the request body is invalid: {error.get('msg', '')}", None
    if kind == "missing":
        return f"'{param}' is required", param
    if kind == "model_attributes_type" or kind == "dict_type":
        return f"'{param}' must be a JSON object", param
    return f"'{param}': {error.get('msg', 'invalid value')}", param


async def _openai_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(exc.status_code, exc.message, exc.param, exc.headers)


async def _param_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """A refusal naming a field (the protocol checks, sampling parameters, a prompt the
    tokenizer or chat template refuses) is the client's to fix: 400 naming the field."""
    assert isinstance(exc, ParamError)
    return error_response(400, exc.message, exc.param)


async def _validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI answers 422 for these; OpenAI clients expect 400 naming the field."""
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    # Report the most specific error: with unions pydantic lists one per member, and the one
    # with the deepest location is the one that got furthest.
    best: dict[str, Any] = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    if best.get("type") == "json_invalid":
        # The body was read (and cached on the request) before validation failed.
        try:
            (await request.body()).decode("utf-8")
        except UnicodeDecodeError as err:
            return error_response(
                400, f"the request body is not valid UTF-8 (bad byte at offset {err.start})"
            )
    message, param = validation_message(best)
    return error_response(400, message, param)


async def _http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers) if exc.headers else None
    return error_response(exc.status_code, str(exc.detail), None, headers)


def log_internal_error(method: str, path: str, exc: BaseException) -> OpenAIError:
    """Log `exc` with its traceback under a fresh id; the 500 to answer names only the id."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s on %s %s", error_id, method, path, exc_info=exc)
    return OpenAIError(
        500, f"internal error ({type(exc).__name__}); the server log has it as {error_id}"
    )


def internal_error(method: str, path: str, exc: BaseException) -> JSONResponse:
    """`log_internal_error`'s 500 as a response."""
    error = log_internal_error(method, path, exc)
    return error_response(error.status_code, error.message)


class InternalErrorMiddleware:
    """Answers an exception that escaped the app with `internal_error`'s 500.

    Installed inside the middleware that counts statuses, so those 500s are counted (starlette
    would answer them from its outermost middleware, past every counter). An exception after
    the response started cannot change it: it is logged, and the response ends there.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message.get("type") == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # answered (500) and logged with its traceback
            method, path = scope.get("method", ""), scope.get("path", "")
            if started:
                logger.error("error after %s %s had started answering", method, path, exc_info=exc)
                return
            await internal_error(method, path, exc)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(ParamError, _param_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
