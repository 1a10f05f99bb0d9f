"""Argument checks shared by the library, the tasks and the config validation.

Each check returns the value (converted) or raises a one-line ``ValueError`` that names the argument, what it got
and what is allowed, e.g. ``d_k must be an integer >= 1, got 0``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_choice", "check_int", "check_number", "check_prob", "default_d_k"]


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an ``int`` within [minimum, maximum] (either bound optional); bools are not integers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer{_range(minimum, maximum)}, got {value!r}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an integer{_range(minimum, maximum)}, got {value}")
    return value


def check_number(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a finite ``float`` in the interval from ``low`` to ``high`` (ends closed unless ``*_open``)."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(float(value))
    if ok:
        x = float(value)
        ok = (low is None or (x > low if low_open else x >= low)) and (
            high is None or (x < high if high_open else x <= high)
        )
    if not ok:
        if low is not None and high is not None:
            allowed = f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            allowed = f" {'>' if low_open else '>='} {low:g}"
        elif high is not None:
            allowed = f" {'<' if high_open else '<='} {high:g}"
        else:
            allowed = ""
        raise ValueError(f"{name} must be a finite number{allowed}, got {value!r}")
    return float(value)


def check_prob(name: str, value: Any, low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a ``float`` in [0, 1] (either end optionally open)."""
    return check_number(name, value, 0.0, 1.0, low_open, high_open)


def check_choice(name: str, value: Any, choices: Any) -> Any:
    """``value`` if it is one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return value


def default_d_k(d_model: int, num_heads: int, d_k: int | None = None) -> int:
    """The per-head key size: ``d_k`` when given, else ``d_model // num_heads``, which must then divide evenly."""
    if d_k is not None:
        return check_int("d_k", d_k, minimum=1)
    if d_model % num_heads:
        raise ValueError(
            f"d_model ({d_model}) is not divisible by num_heads ({num_heads}); set d_k explicitly "
            f"(d_k is free of d_model and num_heads) or pick num_heads dividing {d_model}"
        )
    return d_model // num_heads


def _range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""
