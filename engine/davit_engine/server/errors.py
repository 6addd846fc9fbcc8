"""OpenAI-style errors: the exception handlers raise through and the handlers that render them.

Every error leaves as `{"error": {"message", "type", "param", "code"}}` with a status code an
OpenAI client maps to the right exception class; `param` names the offending field.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from davit_engine.server.protocol import error_body
from davit_engine.types import ParamError

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
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


def error_payload(status_code: int, message: str, param: str | None = None) -> Any:
    """The OpenAI error body for `status_code` (also sent as an SSE event mid-stream)."""
    type_ = _ERROR_TYPES.get(status_code, "BadRequestError" if status_code < 500 else "APIError")
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


async def _internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(ParamError, _param_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _internal_error_handler)
