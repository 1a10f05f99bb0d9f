"""A small name → builder registry, shared by scores and masks.

Three verbs, as in timm: ``register``, ``build``, ``names``. An unknown name raises :class:`UnknownNameError`,
a one-line message that lists what is registered and suggests the closest name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """Raised for a name that is not registered. The message lists the choices and suggests the closest."""


def unknown_name_message(kind: str, name: str, choices: list[str]) -> str:
    """``unknown score 'adittive'; did you mean 'additive'? Registered: additive, alibi, ...``."""
    close = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "."
    return f"unknown {kind} '{name}'{hint} Registered: {', '.join(sorted(choices))}"


class Registry(Generic[T]):
    """Maps names to builders (classes or functions) of one kind of thing.

    ``wrap`` turns whatever was registered plus the build kwargs into the built object, so that plain functions and
    classes can both be registered.
    """

    def __init__(self, kind: str, wrap: Callable[[str, Any, dict[str, Any]], T]) -> None:
        self.kind = kind
        self._entries: dict[str, Any] = {}
        self._wrap = wrap

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator: ``@registry.register("name")`` on a class or function. Returns it unchanged."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(obj: Any) -> Any:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} '{name}' is already registered (by {self._entries[name]!r})")
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> Any:
        """The registered class or function, or :class:`UnknownNameError`."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownNameError(unknown_name_message(self.kind, name, self.names())) from None

    def build(self, name: str, **kwargs: Any) -> T:
        """Build the thing registered as ``name`` with ``kwargs``."""
        return self._wrap(name, self.get(name), kwargs)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
