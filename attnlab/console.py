"""The one way attnlab makes a terminal console: every string it prints, from a config, a run folder, an override
or a user's registration (``register_score("[/x]")``), is text, never Rich markup or emoji codes.

Rich would read ``[bold]``, ``[/x]`` or ``[link=...]`` in a variant's name, a job folder or a config key as markup
and style it, drop it, or raise ``MarkupError`` at the end of a run or a sweep. A console made here has markup,
emoji codes and highlighting off for every ``print`` and for every cell and title of a table it prints. Styles
are still given as objects (``Text(..., style="red")``, ``add_row(..., style=...)``). Control characters (an ANSI
escape in a folder's name) are escaped by :func:`printable`, in this console and in the lines printed without it
(``error: ...`` on stderr).
"""

from __future__ import annotations

from typing import IO, Any

from rich.console import Console

__all__ = ["plain_console", "printable"]


class _PlainConsole(Console):
    """A console whose every string (printed, or a table's cell, header or title) passes :func:`printable` first:
    Rich removes some control codes but not ESC, so a name holding an ANSI sequence would drive the terminal."""

    def render_str(self, text: str, **kwargs: Any) -> Any:
        return super().render_str(printable(text), **kwargs)


def plain_console(file: IO[str] | None = None, width: int = 120) -> Console:
    """A Rich console that prints every string as text (no markup, emoji codes or highlighting, control characters
    escaped), soft-wrapped; when the output is not a terminal (a log file, CI), ``width`` columns instead of Rich's
    assumed 80."""
    console = _PlainConsole(file=file, markup=False, emoji=False, highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console.width = width
    return console


def printable(text: str) -> str:
    """``text`` with every control character (an ANSI escape from a folder name or a file, a newline inside a
    value) written as its escape (``\\x1b``), so that one message stays one line and cannot drive the terminal."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(text))
