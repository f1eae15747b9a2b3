"""Every error the server answers, in OpenAI's body shape
``{"error": {"message", "type", "param", "code"}}``: ours, FastAPI's request
validation, Starlette's 404 and 405, and anything unexpected (500).

Statuses and codes:

===  ==============================  ==========================================
400  invalid_request_error           malformed JSON (``invalid_json``), unknown
                                     field (``unknown_parameter``), wrong type or
                                     value (``invalid_type``, ``invalid_value``),
                                     prompt too long (``context_length_exceeded``),
                                     bad session file name (``invalid_name``),
                                     no ``--session-dir`` (``session_dir_not_set``),
                                     unreadable session file (``invalid_session_file``)
401  authentication_error            missing or wrong API key (``invalid_api_key``)
403  invalid_request_error           the key's saved session files are at their
                                     limit (``session_files_limit``)
404  not_found_error                 unknown session, model, file or path (another
                                     API key's session or file: unknown to this key)
405  invalid_request_error           method not allowed
409  conflict_error                  session busy (``session_busy``) or id taken
                                     (``session_exists``)
429  rate_limit_error                no room for a session (``capacity``), with
                                     ``Retry-After``
500  server_error                    a bug or a failed model run
503  server_error                    the model's engine process ended or is
                                     unresponsive (``engine_unavailable``;
                                     ``/health`` says so)
507  server_error                    the server is out of space for a session
                                     file (``out_of_space``)
===  ==============================  ==========================================
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .._words import bounded
from ..errors import CapacityError, EngineProcessError, SessionBusyError, SessionFileError, SessionFileNotFoundError

log = logging.getLogger("aoti_sessions.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 429: "rate_limit_error", 500: "server_error"}


class APIError(Exception):
    """An answer other than success; raised anywhere in a request's handling."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)

    def __reduce__(self) -> tuple[Any, ...]:  # (a front end raises what the hub's registry raised: serve/_shared.py)
        return APIError, (self.status, self.message, self.code, self.param, self.headers)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body; the message bounded (one quoting a huge input
    keeps its start and end)."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": bounded(message), "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def runtime_error(exc: BaseException, retry_after: int = 1) -> APIError | None:
    """The answer to an exception of the runtime that is the client's to
    handle (None for the rest: a 500)."""
    if isinstance(exc, EngineProcessError):
        return APIError(503, f"the model is unavailable: {exc}", "engine_unavailable")
    if isinstance(exc, CapacityError):
        return APIError(429, f"no room for another session now: {exc}", "capacity",
                        headers={"Retry-After": str(retry_after)})
    if isinstance(exc, SessionBusyError):
        return APIError(409, str(exc), "session_busy", "session_id")
    if isinstance(exc, SessionFileNotFoundError):
        return APIError(404, f"no such session file: {exc}", "file_not_found", "name")
    if isinstance(exc, SessionFileError):
        return APIError(400, f"cannot load the session file: {exc}", "invalid_session_file", "name")
    return None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic names a union's member so


def _field(loc: Sequence[Any]) -> str:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role``; the
    members of a union that pydantic puts in the path (``list[int]``) left out."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).isidentifier() and str(part) not in _TYPE_TAGS:
            out += f".{part}" if out else str(part)
    return out


def validation_error(errors: Sequence[Any]) -> APIError:
    """The first of pydantic's errors, as an OpenAI-style 400 naming the field."""
    first: dict[str, Any] = dict(errors[0]) if errors else {"type": "value_error", "msg": "invalid request"}
    kind, field = str(first.get("type", "")), _field(first.get("loc", ()))
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}",
                        "invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {field}", "unknown_parameter", field)
    if not field and kind in ("model_attributes_type", "dict_type", "model_type"):
        if isinstance(first.get("input"), (bytes, str)):
            return APIError(400, "the body is not JSON: send a JSON object with Content-Type: application/json",
                            "invalid_json")
        return APIError(400, "the body must be a JSON object", "invalid_type")
    if kind == "missing" and not field:
        return APIError(400, "the request needs a JSON body", "invalid_json")
    if kind == "missing":
        return APIError(400, f"{field}: a required field is missing", "missing_required_parameter", field)
    if kind.endswith("_type") or kind in ("model_attributes_type", "dict_type", "list_type"):
        code = "invalid_type"
    else:
        code = "invalid_value"
    message = str(first.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    return APIError(400, f"{field}: {message}" if field else message, code, field or None)


def install(app: FastAPI, retry_after: int = 1) -> None:
    """Answers every error of ``app`` in OpenAI's shape."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        error = validation_error(exc.errors())
        return error_response(error.status, error.message, error.code, error.param)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
            return error_response(404, message, "not_found", headers=exc.headers)
        if exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
            return error_response(405, message, "method_not_allowed", headers=exc.headers)
        if exc.status_code == 400:  # FastAPI's only one: a body it could not parse
            cause = exc.__cause__
            why = "not UTF-8 text" if isinstance(cause, UnicodeDecodeError) else "it could not be parsed"
            return error_response(400, f"malformed JSON body: {why}", "invalid_json")
        return error_response(exc.status_code, str(exc.detail), None, headers=exc.headers)

    async def on_runtime(request: Request, exc: Exception) -> JSONResponse:
        error = runtime_error(exc, retry_after)
        assert error is not None  # (runtime_error answers each kind registered below)
        return error_response(error.status, error.message, error.code, error.param, error.headers)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    for kind in (CapacityError, SessionBusyError, SessionFileError, EngineProcessError):
        app.add_exception_handler(kind, on_runtime)
    # Anything else is answered by the app's outermost middleware
    # (unexpected()): an Exception handler here would run in Starlette's
    # error middleware, which raises the error on to the server after it
    # answers, and the server logs it a second time.


def unexpected(where: str, exc: BaseException) -> APIError:
    """The 500 for an error nobody expected: its traceback to the log, once,
    under a reference; the client gets the error's kind and the reference,
    no server internals (paths, C++ sources)."""
    reference = f"{time.time_ns():x}"
    log.error("unexpected error %s (reference %s)", where, reference, exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__}; reference {reference} in the server's "
                         "log)", "internal_error")


def sse_error(error: APIError) -> bytes:
    """An error met after a stream began: one more event, then the stream ends
    (OpenAI's clients raise it)."""
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"
