"""Errors in OpenAI's body shape, and the handlers that turn every failure of a request into one.

Bad input is always a 400 that names the offending field: pydantic's 422 and engine ValueErrors are mapped here,
so a client never sees a 422 or a 500 for something it sent.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A request failure with its HTTP status; `param` names the request field at fault, if one is."""

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers  # e.g. Retry-After on a 503 for overload


def bad_request(err: ValueError, fields: set[str] | frozenset[str] = frozenset()) -> APIError:
    """A 400 from an engine ValueError; its message starts with the field name, which becomes `param`."""
    message = str(err)
    first_word = message.split(" ", 1)[0]
    return APIError(400, message, first_word if first_word in fields else None)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "error"),
            "param": param,
            "code": status,
        }
    }


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def describe_validation_error(err: RequestValidationError) -> tuple[str, str | None]:
    """One readable message for pydantic's list of errors, and the dotted path of the first field at fault.

    A value that fits no member of a union gets one error per member, each path ending in the member's name
    (`prompt.str`, `prompt.list[int]`); the field is the path those errors share."""
    parts, first_loc = [], None
    for detail in err.errors():
        loc = [str(p) for p in detail.get("loc", ()) if p != "body"]
        if detail.get("type") == "json_invalid":
            loc = []  # its location is a character offset, not a field
        field = ".".join(loc) or None
        if first_loc is None:
            first_loc = loc
        elif loc[:1] == first_loc[:1]:
            first_loc = _common_prefix(first_loc, loc)
        if detail.get("type") == "extra_forbidden":
            parts.append(f"unknown or unsupported field {field!r}")
        elif detail.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {detail.get('msg')}")
        else:
            parts.append(f"{field}: {detail.get('msg')}" if field else str(detail.get("msg")))
    return "; ".join(parts) or "invalid request", ".".join(first_loc or ()) or None


def _common_prefix(a: list[str], b: list[str]) -> list[str]:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return a[:length]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.param, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(400, *describe_validation_error(err))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, err: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return error_response(500, f"internal server error: {type(err).__name__}")
