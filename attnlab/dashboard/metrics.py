"""How the dashboard draws a metric: a registry of metric families keyed by a name pattern.

A run logs flat names (``test/acc``, ``attn/entropy_norm``, ``test/acc@64``, ``attn/L1H0/saturation``). The
naming convention splits them into a *base* name and where it was measured:

* ``<base>@<L>``            the metric on the extra test set of length ``L`` (drawn against ``L``);
* ``attn/L<l>H<h>/<stat>``  one head of one layer (drawn as a layer × head heatmap);
* ``attn/L<l>/<stat>``      one layer's mean (listed in the CSV only);
* anything else             one number per run (drawn against the swept keys).

The base name picks a :class:`MetricSpec` from the first family whose pattern matches it: the axis title and
unit, the range that intervals are clipped to, which direction is better, whether the task's chance accuracy is
drawn, and whether the value is shown as a percentage. A metric that no family names still gets drawn, with a
plain spec; a new family is one :func:`register_metric` call, and every chart, table and CSV column picks it up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["MetricSpec", "parse_metric", "register_metric", "spec_for"]


@dataclass(frozen=True)
class MetricSpec:
    """How to draw and rank one family of metrics.

    Attributes:
        title: what the metric is, for axis titles ("accuracy", "normalised entropy").
        unit: the unit shown after the title ("%", "nats", "bits/byte", "steps"; "" for a plain ratio).
        low, high: the metric's possible range (None = unbounded); intervals are clipped to it.
        higher_is_better: the direction that wins (None: no winner is named, e.g. a diagnostic).
        percent: a fraction shown as a percentage (0.875 → 87.5 %).
        chance: draw the task's chance accuracy as a dashed line.
        log_y: draw on a log y axis.
    """

    title: str
    unit: str = ""
    low: float | None = None
    high: float | None = None
    higher_is_better: bool | None = None
    percent: bool = False
    chance: bool = False
    log_y: bool = False

    def axis_title(self, name: str) -> str:
        """``"test/acc: accuracy (%)"`` for an axis."""
        unit = f" ({self.unit})" if self.unit else ""
        return f"{name}: {self.title}{unit}"

    def format(self, value: float | None, digits: int = 3) -> str:
        """A value as text: ``87.5 %`` for a percentage, else ``digits`` significant digits."""
        if value is None:
            return "-"
        if self.percent:
            return f"{100 * value:.1f} %"
        return f"{value:.{digits}g}"

    def format_margin(self, value: float) -> str:
        """A difference of two values: ``5.1 points`` for a percentage."""
        return f"{100 * value:.1f} points" if self.percent else f"{value:.3g}"

    def scale(self) -> float:
        """What a value is multiplied by for display (100 for a percentage)."""
        return 100.0 if self.percent else 1.0


_FAMILIES: list[tuple[re.Pattern[str], MetricSpec]] = []


def register_metric(pattern: str, title: str, **spec: Any) -> MetricSpec:
    """Register how to draw the metrics whose base name fully matches the regular expression ``pattern``
    (families registered later take precedence). Returns the spec."""
    made = MetricSpec(title=title, **spec)
    _FAMILIES.insert(0, (re.compile(pattern), made))
    return made


_FRACTION = {"low": 0.0, "high": 1.0}
# registered from the most general to the most specific (the last registered is tried first)
register_metric(r".*", "value")
register_metric(r".*/acc(_best)?", "accuracy", unit="%", percent=True, higher_is_better=True, chance=True, **_FRACTION)
register_metric(r".*/loss", "cross-entropy", unit="nats", low=0.0, higher_is_better=False)
register_metric(r".*/bpc", "bits per byte", unit="bits/byte", low=0.0, higher_is_better=False)
register_metric(r"train/(plateau_steps|steps_to_99)", "steps to reach", unit="steps", low=0.0, higher_is_better=False)
register_metric(r"attn/entropy", "attention entropy", unit="nats", low=0.0)
register_metric(r"attn/entropy_norm", "entropy / log(keys)", **_FRACTION)
register_metric(r"attn/saturation", "rows with max weight > 0.99", unit="fraction", **_FRACTION)
register_metric(r"attn/max_prob", "max attention weight", **_FRACTION)
register_metric(r"attn/support", "keys with weight ≠ 0", unit="fraction", **_FRACTION)
register_metric(r"attn/row_mass", "sum of a row's weights")
register_metric(r"attn/negative_mass", "weight below 0", low=0.0)
register_metric(r"attn/first_mass", "weight on the first key")
register_metric(r"attn/logit_std", "std of a row's logits", low=0.0)
register_metric(r"attn/logit_max", "largest logit")
register_metric(r"attn/attn_distance", "mean |i − j| attended", unit="tokens", low=0.0)

_LENGTH = re.compile(r"^(?P<base>.+)@(?P<length>\d+)$")
_HEAD = re.compile(r"^attn/L(?P<layer>\d+)H(?P<head>\d+)/(?P<stat>\w+)$")
_LAYER = re.compile(r"^attn/L(?P<layer>\d+)/(?P<stat>\w+)$")


def parse_metric(name: str) -> tuple[str, str, dict[str, int]]:
    """``(kind, base, where)`` of a logged name: kind is ``"length"`` (``test/acc@64`` → base ``test/acc``,
    ``{"length": 64}``), ``"head"`` (``attn/L1H0/saturation`` → ``attn/saturation``, layer and head), ``"layer"``
    or ``"scalar"``."""
    if match := _LENGTH.match(name):
        return "length", match["base"], {"length": int(match["length"])}
    if match := _HEAD.match(name):
        return "head", f"attn/{match['stat']}", {"layer": int(match["layer"]), "head": int(match["head"])}
    if match := _LAYER.match(name):
        return "layer", f"attn/{match['stat']}", {"layer": int(match["layer"])}
    return "scalar", name, {}


def spec_for(name: str) -> MetricSpec:
    """The spec of a metric (of its base name, for ``@L`` and per-head names)."""
    base = parse_metric(name)[1]
    for pattern, spec in _FAMILIES:
        if pattern.fullmatch(base):
            return spec
    raise AssertionError("the catch-all family is always registered")  # pragma: no cover
