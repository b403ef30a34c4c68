"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from quantserve.server.exceptions import (EngineClosedError, EngineError, NoChatTemplateError, OutOfMemoryError,
                                          OutputFormatError, QueueFullError)
from quantserve.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable"}


# The engine's errors by kind -> (HTTP status, OpenAI error code): the one place that decides.
# First match wins, so subclasses come before EngineError.
ENGINE_ERRORS: list[tuple[type, int, str]] = [
    (OutOfMemoryError, 503, "out_of_memory"),  # retrying later may work
    (QueueFullError, 429, "queue_full"),
    (EngineClosedError, 503, "shutting_down"),
    (NoChatTemplateError, 400, "no_chat_template"),
    (OutputFormatError, 400, "invalid_output_format"),
    (EngineError, 500, "engine_error"),
]


def engine_status(error: BaseException) -> tuple[int, str]:
    for kind, status, code in ENGINE_ERRORS:
        if isinstance(error, kind):
            return status, code
    return 500, "engine_error"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    info = ErrorInfo(message=message, type=_TYPES.get(status, "invalid_request_error"), param=param, code=code)
    return ErrorResponse(error=info).model_dump()


class _ASCIIJSONResponse(JSONResponse):
    """Error bodies escape non-ASCII: they may quote what a client sent, lone surrogates included,
    which UTF-8 cannot encode (Starlette's JSONResponse would fail while reporting the error)."""

    def render(self, content) -> bytes:
        import json

        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return _ASCIIJSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_api_error(e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.param, e.code, e.headers)
