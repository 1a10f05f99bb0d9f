"""The one way attnlab makes a terminal console: every string it prints, from a config, a run folder, an override
or a user's registration (``register_score("[/x]")``), is text, never Rich markup or emoji codes.

Rich would read ``[bold]``, ``[/x]`` or ``[link=...]`` in a variant's name, a job folder or a config key as markup
and style it, drop it, or raise ``MarkupError`` at the end of a run or a sweep. A console made here has markup,
emoji codes and highlighting off for every ``print`` and for every cell and title of a table it prints. Styles
are still given as objects (``Text(..., style="red")``, ``add_row(..., style=...)``). Rich drops control codes
from what it prints; lines printed without Rich (``error: ...`` on stderr) go through :func:`printable`.
"""

from __future__ import annotations

from typing import IO

from rich.console import Console

__all__ = ["plain_console", "printable"]


def plain_console(file: IO[str] | None = None, width: int = 120) -> Console:
    """A Rich console that prints every string as text (no markup, emoji codes or highlighting), soft-wrapped; when
    the output is not a terminal (a log file, CI), ``width`` columns instead of Rich's assumed 80."""
    console = Console(file=file, markup=False, emoji=False, highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console.width = width
    return console


def printable(text: str) -> str:
    """``text`` with every control character (an ANSI escape from a folder name or a file, a newline inside a
    value) written as its escape (``\\x1b``), so that one message stays one line and cannot drive the terminal."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(text))
