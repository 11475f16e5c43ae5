"""Errors the embedded server's handlers raise; the middleware turns them into HTTP replies."""


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
