"""Errors in OpenAI's JSON shape, so clients' own error handling works unchanged.

Every failure the API layer knows about is raised as ``APIError`` and rendered by
``error_response`` as ``{"error": {"message", "type", "param", "code"}}``. Pydantic's
validation errors are turned into one readable message that names the offending field.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from pydantic import ValidationError

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request that cannot be served, with the status and OpenAI error fields to report."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers  # extra response headers (Connection: close for 408/413)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status_code, "invalid_request_error")

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.",
                    param="model", code="model_not_found")


def from_validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, as "<field>: <what is wrong>"."""
    first = error.errors(include_url=False)[0]
    # Union members add their type name to the location ("prompt.str"); drop those parts.
    location = [str(part) for part in first["loc"]
                if not (isinstance(part, str) and ("[" in part or part in _TYPE_TAGS))]
    param = ".".join(location) or None
    if first["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return bad_request(f"{param}: field required", param=param)
    message = first["msg"].removeprefix("Value error, ")
    # A union field reports one error per member; count fields, not errors.
    more = len({err["loc"][:1] for err in error.errors()}) - 1
    suffix = f" (and {more} more field{'s' if more > 1 else ''} with problems)" if more else ""
    return bad_request(f"{param}: {message}{suffix}" if param else message + suffix,
                       param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "function-wrap"}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=int(error.status_code), headers=error.headers)


def add_openai_error_handlers(app: FastAPI, not_found_message: str) -> None:
    """Answer ``APIError`` and Starlette's own HTTP errors (unknown path, wrong method) in
    OpenAI's error shape; ``not_found_message`` names the endpoints this app serves."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, error: Exception) -> JSONResponse:
        # The details are for the operator's log; a client learns nothing of the internals.
        logger.exception("unhandled error while serving a request")
        return error_response(APIError(500, "internal error while serving this request; the "
                                       "server logged the details", code="internal_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        message = str(error.detail) if error.detail else "error"
        if error.status_code == 404:
            message = not_found_message
        return error_response(APIError(error.status_code, message))
