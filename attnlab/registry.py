"""A small name → builder registry, shared by scores, position biases, masks and normalizers.

Three verbs, as in timm: ``register``, ``build``, ``names``. An unknown name raises :class:`UnknownNameError`,
a one-line message that lists what is registered and suggests the closest name.

Every registry is also found by its kind (:func:`registry_of`): a helper that asks about registered names of another
kind (does the score ``t5_like`` take ``bidirectional``?) reads that registry here, at the bottom, instead of
importing the module that fills it (which may sit above it: :mod:`attnlab.position_bias` and the scores).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_BY_KIND: dict[str, Registry[Any]] = {}


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
        _BY_KIND[kind] = self  # (the latest of a kind: a reloaded module's registry replaces the old one)

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


def registry_of(kind: str) -> Registry[Any] | None:
    """The registry of ``kind`` (``"score"``, ``"position bias"``, ``"preset"`` ...), or None while no module has
    made one (then nothing of that kind is registered either)."""
    return _BY_KIND.get(kind)


def check_params(
    kind: str, name: str, target: Callable[..., Any], params: dict[str, Any], implicit: tuple[str, ...]
) -> None:
    """One clear line for a parameter that ``target`` (a registered class or function) does not take:
    ``score 'alibi' does not take parameter 'clip'; allowed: (none)``. ``implicit`` names the arguments the
    pipeline passes itself (``q``, ``k``, ``logits`` ...), which are not listed as allowed."""
    sig = inspect.signature(target)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    allowed = [p for p in sig.parameters if p not in ("self", *implicit)]
    for key in params:
        if key not in allowed:
            raise ValueError(
                f"{kind} '{name}' does not take parameter '{key}'; allowed: {', '.join(allowed) or '(none)'}"
            )


def build_with_sizes(kind: str, name: str, obj: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The build kwargs for a registered class: d_k and num_heads are required, d_v is passed only when the class
    takes it, d_model only when the class names it, and any other parameter must be one the class takes."""
    kwargs = dict(kwargs)
    for required in ("d_k", "num_heads"):
        if required not in kwargs:
            raise ValueError(f"build_{kind.replace(' ', '_')}('{name}') needs {required}=")
    sizes = ("d_k", "num_heads", "d_v", "d_model")
    check_params(kind, name, obj, {k: v for k, v in kwargs.items() if k not in sizes}, sizes)
    sig = inspect.signature(obj)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    if "d_v" not in sig.parameters and not takes_any:
        kwargs.pop("d_v", None)
    if "d_model" not in sig.parameters:  # only a class that names it (the decay and delta-rule forms' gates)
        kwargs.pop("d_model", None)
    return kwargs


class BoundedCache(dict):
    """A dict of derived tensors (masks, position indices, biases) keyed by shape, device and dtype, that forgets
    everything once it holds more than ``max_size`` entries, so that a model run at many lengths never grows it
    without bound. Entries are shared: treat them as read-only."""

    def __init__(self, max_size: int = 16) -> None:
        super().__init__()
        self.max_size = max_size

    def get_or_make(self, key: Hashable, make: Callable[[], T]) -> T:
        """The entry for ``key``, made by ``make()`` the first time."""
        value = self.get(key)
        if value is None:
            if len(self) >= self.max_size:
                self.clear()
            value = self[key] = make()
        return value
