"""Errors the embedded server's handlers raise; the middleware turns them into HTTP replies (`error`)."""

from __future__ import annotations

from typing import Any

from aiohttp import web


class RequestError(Exception):
    """An error reply with {"error": {"message": ...}} (plus OpenAI's type/param/code on /v1/* paths)."""

    status = 400


class BadRequest(RequestError):
    """400: the request is malformed or asks for something the server does not do."""

    status = 400


class PayloadTooLarge(RequestError):
    """413: the request body is over the server's byte limit (refused before it is parsed)."""

    status = 413


class TooManyQueued(RequestError):
    """429: the server already holds its limit of queued tokens; retry later."""

    status = 429


def short(v: Any, n: int = 60) -> str:
    """repr of a client's value, cut to `n` characters for error messages."""
    r = repr(v)
    return r if len(r) <= n else r[:n] + "…"


def error(message: str, status: int = 400, openai: bool = False) -> web.Response:
    """The error reply: {"error": {"message": …}}, plus OpenAI's type/param/code on /v1/* paths."""
    body: dict[str, Any] = {"message": message}
    if openai:  # OpenAI's error object is a superset of the native one
        kind = {400: "BadRequestError", 401: "Unauthorized", 413: "RequestTooLargeError",
                429: "RateLimitError"}.get(status, "InternalServerError")
        body.update(type=kind, param=None, code=status)
    return web.json_response({"error": body}, status=status)
