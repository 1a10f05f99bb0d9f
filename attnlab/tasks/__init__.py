"""Synthetic and bundled sequence-classification tasks as LightningDataModules (nothing is downloaded).

``TASKS`` maps a task name to its class; :func:`make_task` builds one by name.
"""

from __future__ import annotations

from typing import Any

from attnlab.tasks.associative_recall import AssociativeRecall
from attnlab.tasks.base import IGNORE_INDEX, PAD_ID, SequenceTask
from attnlab.tasks.digits import Digits
from attnlab.tasks.listops import ListOps
from attnlab.tasks.position import Reverse, Shift, Sort
from attnlab.tasks.text import TextLM

TASKS: dict[str, type[SequenceTask]] = {
    "associative_recall": AssociativeRecall,
    "listops": ListOps,
    "digits": Digits,
    "text": TextLM,
    "shift": Shift,
    "reverse": Reverse,
    "sort": Sort,
}


def make_task(name: str, **kwargs: Any) -> SequenceTask:
    """Instantiate the task called ``name`` (a key of :data:`TASKS`) with ``kwargs``."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name](**kwargs)


__all__ = [
    "IGNORE_INDEX",
    "PAD_ID",
    "TASKS",
    "AssociativeRecall",
    "Digits",
    "ListOps",
    "Reverse",
    "SequenceTask",
    "Shift",
    "Sort",
    "TextLM",
    "make_task",
]
