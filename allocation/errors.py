"""The one exception type of the `allocation` package.

`AllocationError` is raised for every problem with an allocation string or with placing it on a
cluster: it carries the offending string, a 0-based column into it, a short message and a hint
that names the fix. ``str(err)`` renders the string with a caret under the column.

This module does not parse anything itself; see `allocation.parser`.
"""

from __future__ import annotations


def _printable(text: str) -> str:
    """Replace characters that would break caret alignment (tabs, newlines, controls) by spaces."""
    return "".join(ch if ch.isprintable() else " " for ch in text)


class AllocationError(ValueError):
    """A bad allocation string, or an allocation that does not fit the cluster.

    Attributes:
        message: what is wrong, in one line.
        source: the allocation string as the user wrote it.
        column: 0-based index into ``source`` where the problem is (``len(source)`` = at the end).
        hint: how to fix it.
    """

    def __init__(self, message: str, source: str, column: int, hint: str) -> None:
        self.message = message
        self.source = source
        self.column = max(0, min(column, len(source)))
        self.hint = hint
        super().__init__(message, source, self.column, hint)


    def __str__(self) -> str:
        return (
            f"invalid allocation: {self.message}\n"
            f"  {_printable(self.source)}\n"
            f"  {' ' * self.column}^\n"
            f"hint: {self.hint}"
        )
