"""Sequence-classification tasks as LightningDataModules (nothing is downloaded), and their registry.

Three verbs, as for scores and masks: ``@register_task("name")`` on a :class:`~attnlab.tasks.base.SequenceTask`
subclass, :func:`list_tasks`, :func:`build_task`. The built-in tasks are the modules of this package, each
registering its own classes; they are imported the first time the registry is asked (so ``import attnlab`` does
not pay for Lightning and scikit-learn). A task of your own comes in through your module:
``python train.py task=custom task.name=<name> 'imports=[your_module]'``.

The task classes (``Digits``, ``Shift``, ...) and the names of :mod:`attnlab.tasks.base` are importable from here
too; ``TASKS`` is a read-only name → class view of the registry (kept for older code). ``make_task``, the old name
of :func:`build_task`, reads through :mod:`attnlab.compat` (with a DeprecationWarning).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from attnlab.compat import forward
from attnlab.registry import Registry

if TYPE_CHECKING:
    from attnlab.tasks.associative_recall import AssociativeRecall
    from attnlab.tasks.base import IGNORE_INDEX, PAD_ID, DataOptions, SequenceTask
    from attnlab.tasks.digits import Digits
    from attnlab.tasks.listops import ListOps
    from attnlab.tasks.mad import Compression, FuzzyRecall, Memorization, NoisyRecall, SelectiveCopy
    from attnlab.tasks.position import Reverse, Shift, Sort
    from attnlab.tasks.recall_variants import CompositionalRecall, ForgettingRecall
    from attnlab.tasks.state_tracking import Modular, Parity, Permutation
    from attnlab.tasks.text import TextLM

__all__ = [
    "IGNORE_INDEX",
    "PAD_ID",
    "TASKS",
    "AssociativeRecall",
    "CompositionalRecall",
    "Compression",
    "DataOptions",
    "Digits",
    "ForgettingRecall",
    "FuzzyRecall",
    "ListOps",
    "Memorization",
    "Modular",
    "NoisyRecall",
    "Parity",
    "Permutation",
    "Reverse",
    "SelectiveCopy",
    "SequenceTask",
    "Shift",
    "Sort",
    "TextLM",
    "build_task",
    "list_tasks",
    "register_task",
    "task_class",
]

# the names this package exports from its modules, imported when first asked for (PEP 562)
_LAZY = {
    "IGNORE_INDEX": "base",
    "PAD_ID": "base",
    "DataOptions": "base",
    "SequenceTask": "base",
    "AssociativeRecall": "associative_recall",
    "Digits": "digits",
    "ListOps": "listops",
    "FuzzyRecall": "mad",
    "NoisyRecall": "mad",
    "SelectiveCopy": "mad",
    "Compression": "mad",
    "Memorization": "mad",
    "Reverse": "position",
    "Shift": "position",
    "Sort": "position",
    "CompositionalRecall": "recall_variants",
    "ForgettingRecall": "recall_variants",
    "Modular": "state_tracking",
    "Parity": "state_tracking",
    "Permutation": "state_tracking",
    "TextLM": "text",
}


def _build(name: str, cls: Any, kwargs: dict[str, Any]) -> Any:
    return cls(**kwargs)


_TASKS: Registry[Any] = Registry("task", _build)
_builtins_loaded = False


def _load_builtins() -> None:
    """Import every module of this package once: the built-in tasks register themselves."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True  # (first: a built-in module that asks the registry while it loads finds it loading)
    try:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
    except BaseException:
        _builtins_loaded = False
        raise


def register_task(name: str) -> Callable[[type], type]:
    """Decorator registering a :class:`~attnlab.tasks.base.SequenceTask` subclass as the task ``name`` (and
    setting its ``name`` attribute). Its ``__init__`` takes its own arguments and passes ``**data`` (the
    :class:`~attnlab.tasks.base.DataOptions`: ``batch_size``, ``num_train``, ``seed``, ...) to
    ``super().__init__``. A name already taken by another class is refused."""
    register = _TASKS.register(name)

    def decorator(cls: type) -> type:
        from attnlab.tasks.base import SequenceTask

        if not (isinstance(cls, type) and issubclass(cls, SequenceTask)):
            raise TypeError(f"register_task('{name}') needs a subclass of attnlab.tasks.SequenceTask, got {cls!r}")
        if not cls.__module__.startswith(f"{__name__}."):
            _load_builtins()  # a task of your own may not take a built-in's name
        own = cls.__dict__.get("name")
        if own is not None and own != name:
            raise ValueError(f"{cls.__name__}.name is '{own}' but it is registered as task '{name}'")
        register(cls)
        cls.name = name
        return cls

    return decorator


def list_tasks() -> list[str]:
    """Names of the registered tasks, sorted."""
    _load_builtins()
    return _TASKS.names()


def task_class(name: str) -> type[SequenceTask]:
    """The class registered as ``name``; :class:`~attnlab.registry.UnknownNameError` (one line, with the closest
    name) for one that is not."""
    _load_builtins()
    return _TASKS.get(name)


def build_task(name: str, **params: Any) -> SequenceTask:
    """Build the task ``name`` (not set up: its data is generated by ``setup``):
    ``build_task("shift", offset=2, num_train=500)``."""
    _load_builtins()
    return _TASKS.build(name, **params)


class _TaskView(Mapping[str, Any]):
    """``TASKS``: the registry as a read-only mapping from name to class."""

    def __getitem__(self, name: str) -> type[SequenceTask]:
        if name not in list_tasks():
            raise KeyError(name)
        return _TASKS.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(list_tasks())

    def __len__(self) -> int:
        return len(list_tasks())

    def __repr__(self) -> str:
        return f"TASKS({', '.join(list_tasks())})"


TASKS: Mapping[str, type[SequenceTask]] = _TaskView()


def _lazy(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__getattr__ = forward(__name__, _lazy)  # the old names first (attnlab.compat's table), then the lazy ones


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
