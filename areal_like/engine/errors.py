"""Errors the embedded server's handlers raise; the middleware turns them into HTTP replies."""


class BadRequest(Exception):
    """A 400 with {"error": {"message": ...}} (plus OpenAI's type/param/code on /v1/* paths)."""
