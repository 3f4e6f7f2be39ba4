"""Every error the server answers, in the OpenAI envelope `{"error": {message, type, param, code}}`.

FastAPI's own answers (422 validation, 404 unknown route, 405 wrong method) and anything
unexpected are rewritten into the same envelope, so a client never sees another shape.
A request problem is a 4xx naming the field (`param`); a 5xx means a bug or a lost worker.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from longserve.server.api.protocol import ErrorBody, ErrorResponse

log = logging.getLogger("longserve.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    426: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    507: "server_error",
}


class APIError(Exception):
    """Raise from a handler: answered as `status` with the OpenAI error envelope."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=ERROR_TYPES.get(status, "invalid_request_error"),
                                         param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class StoreUnavailable(RuntimeError):
    """The job store does not answer (a database that refuses or drops connections, no connection within
    `--store-timeout`): the API answers 503 `storage_unavailable` with Retry-After, /health says degraded."""


#: what a client is told to wait before trying again while the job store does not answer
STORE_RETRY_AFTER_S = 5


def store_unavailable_response(exc: Exception) -> JSONResponse:
    return error_response(503, f"the server's job store does not answer; retry in a few seconds ({exc})", None,
                          "storage_unavailable", {"Retry-After": str(STORE_RETRY_AFTER_S)})


def validation_error(exc: ValidationError | RequestValidationError, prefix: tuple = ()) -> APIError:
    """The first problem of a pydantic validation, as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in prefix]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    msg = first.get("msg", "invalid value")
    if kind == "missing":
        message = f"{param} is required"
        code = "missing_required_parameter"
    elif kind == "extra_forbidden":
        message = f"{param}: unknown parameter"
        code = "unknown_parameter"
    else:
        msg = msg.removeprefix("Value error, ")
        message = f"{param}: {msg}" if param else msg
        code = "invalid_value"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError):
        # query/path parameters: loc is ("query", "limit") -> param "limit"
        err = validation_error(exc, prefix=("query", "path", "body", "header"))
        return error_response(err.status, err.message, err.param, err.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
            code = "unknown_url"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message = str(exc.detail)
            code = None
        return error_response(exc.status_code, message, None, code, getattr(exc, "headers", None))

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(request: Request, exc: StoreUnavailable):
        log.warning("%s %s: %s", request.method, request.url.path, exc)
        return store_unavailable_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        from longserve.server.media import storage_error_code

        code = storage_error_code(exc)
        if code is not None:          # a full disk or a failing database: the client may retry later
            log.error("storage error on %s %s: %s", request.method, request.url.path, exc)
            return error_response(507 if code == "storage_full" else 503,       # the log has the file's path
                                  f"the server's storage failed ({code})", None, code, {"Retry-After": "30"})
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}", None, "internal_error")
