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

Where a metric is listed by name (the page's views, the terminal table, the CSV columns) is registered here too:
:func:`show_metric` puts a logged name in some of the :data:`VIEWS`, in the order of the calls, and
:func:`metrics_in` lists a view's metrics; the page and the CLI hold no list of their own. A logged metric that
no :func:`show_metric` call names still appears in the final-metrics charts (a ``test/``, ``val/`` or ``attn/``
name, after the listed ones), as it did before it was registered."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from attnlab.registry import unknown_name_message

__all__ = [
    "VIEWS",
    "MetricSpec",
    "listed_metrics",
    "metrics_in",
    "parse_metric",
    "plain_number",
    "register_metric",
    "short_name",
    "show_metric",
    "si_number",
    "spec_for",
]


@dataclass(frozen=True)
class MetricSpec:
    """How to draw and rank one family of metrics.

    Attributes:
        title: what the metric is, for axis titles ("accuracy", "normalised entropy").
        unit: the unit shown after the title ("%", "nats", "bits/byte", "steps"; "" for a plain ratio).
        low, high: the metric's possible range (None = unbounded); intervals are clipped to it (:meth:`clip`).
        higher_is_better: the direction that wins (None: no winner is named, e.g. a diagnostic).
        percent: a fraction shown as a percentage (0.875 → 87.5 %).
        chance: draw the task's chance accuracy as a dashed line.
        log_y: draw on a log y axis.
        si: a count shown with an SI prefix (704572 → ``705k``, 1.2e9 → ``1.2G``): FLOPs, parameters, tokens.
    """

    title: str
    unit: str = ""
    low: float | None = None
    high: float | None = None
    higher_is_better: bool | None = None
    percent: bool = False
    chance: bool = False
    log_y: bool = False
    si: bool = False

    def axis_title(self, name: str) -> str:
        """``"test/acc: accuracy (%)"`` for an axis."""
        unit = f" ({self.unit})" if self.unit else ""
        return f"{name}: {self.title}{unit}"

    def format(self, value: float | None, digits: int = 3) -> str:
        """A value as text: ``87.5 %`` for a percentage, else ``digits`` significant digits in plain notation
        (``1234``, ``0.0123``; an exponent only below 1e-4 or from 1e6 on)."""
        if value is None:
            return "-"
        if self.percent:
            return f"{100 * value:.1f} %"
        return si_number(value, digits) if self.si else plain_number(value, digits)

    def format_margin(self, value: float) -> str:
        """A difference of two values: ``5.1 points`` for a percentage."""
        return f"{100 * value:.1f} points" if self.percent else plain_number(value, 3)

    def format_half(self, half_width: float) -> str:
        """The half-width of a 95 % interval in the display unit (points for a percentage), as printed after
        "±" everywhere (page, verdicts, hover texts): 2 significant digits for a percentage, else 3, in plain
        notation; ``> 100`` (``> 1`` for a fraction) when it is at least the width of the metric's range, where the
        interval says nothing (two seeds: t = 12.7 times their spread / 2)."""
        if self.low is not None and self.high is not None and half_width >= self.high - self.low:
            return f"> {plain_number((self.high - self.low) * self.scale(), 3)}"
        return plain_number(half_width * self.scale(), 2 if self.percent else 3)

    def clip(self, low: float, high: float, values: Sequence[float] = ()) -> tuple[float, float]:
        """The interval ``(low, high)`` clipped to the metric's range. A bound that one of the ``values`` breaks is
        not applied (``first_mass`` and ``row_mass`` are in [0, 1] / >= 0 for every normalizer but the signed
        weights of differential attention)."""
        if self.low is not None and all(v >= self.low for v in values):
            low = max(low, self.low)
        if self.high is not None and all(v <= self.high for v in values):
            high = min(high, self.high)
        return low, high

    def scale(self) -> float:
        """What a value is multiplied by for display (100 for a percentage)."""
        return 100.0 if self.percent else 1.0


_FAMILIES: list[tuple[re.Pattern[str], MetricSpec]] = []

VIEWS: dict[str, str] = {
    "final": "the final-metrics charts, after the headline's metrics",
    "init": "the step-0 diagnostics ('At initialisation')",
    "curve": "the training curves",
    "head": "the per layer x head heatmaps (from the logged attn/L<l>H<h>/<stat>)",
    "table": "a column of the page's runs table and of the terminal table",
    "csv": "a column of the CSV export (a diagnostic, attn/..., also as init/<name>)",
    "length": "a CSV column <name>@<L> for every test length L a run reports",
    "compute": "a CSV column after params and state_size (a compute field of summary.json, read by Run.final)",
    "terminal": "a column of the terminal table only, where some run reports it (titled by its short name)",
    "pareto": "a row of the Pareto view: the metric against each cost (one row per metric a finished run reports)",
    "cost": "a panel of the Pareto view: the metric against it, log x (drawn only when every cost is reported)",
}
"""The places the dashboard lists metrics by name: ``view → what it is``."""


@dataclass(frozen=True)
class _Listing:
    views: tuple[str, ...]
    short: str


_LISTED: dict[str, _Listing] = {}


def register_metric(pattern: str, title: str, *, views: Sequence[str] | None = None, **spec: Any) -> MetricSpec:
    """Register how to draw the metrics whose base name fully matches the regular expression ``pattern``
    (families registered later take precedence). Returns the spec.

    ``views``: for a family that is one metric (``pattern`` a plain name such as ``attn/my_stat``), also list it
    in these :data:`VIEWS` (:func:`show_metric`)."""
    if views is not None and re.escape(pattern) != pattern:
        raise ValueError(f"views=... lists one metric by name; {pattern!r} is a pattern (use show_metric per name)")
    made = MetricSpec(title=title, **spec)
    _FAMILIES.insert(0, (re.compile(pattern), made))
    if views is not None:
        show_metric(pattern, *views)
    return made


def show_metric(name: str, *views: str, short: str | None = None) -> None:
    """List the logged metric ``name`` in ``views`` (keys of :data:`VIEWS`; none: known, but listed nowhere, so the
    final-metrics charts leave it out too). Views list their metrics in the order of the calls; a second call for a
    name replaces its views and keeps its place. ``short``: its column title in the terminal table."""
    for view in views:
        if view not in VIEWS:
            raise ValueError(unknown_name_message("dashboard view", view, list(VIEWS)))
    _LISTED[name] = _Listing(tuple(dict.fromkeys(views)), short or name)


def metrics_in(view: str) -> list[str]:
    """The metrics listed in ``view``, in the order they were registered."""
    if view not in VIEWS:
        raise ValueError(unknown_name_message("dashboard view", view, list(VIEWS)))
    return [name for name, listing in _LISTED.items() if view in listing.views]


def listed_metrics() -> list[str]:
    """Every metric registered with :func:`show_metric` (whatever its views)."""
    return list(_LISTED)


def short_name(name: str) -> str:
    """The metric's column title in the terminal table (``ent_n`` for ``attn/entropy_norm``), else its name."""
    listing = _LISTED.get(name)
    return listing.short if listing else name


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
register_metric(r"attn/row_mass", "sum of a row's weights", low=0.0)
register_metric(r"attn/negative_mass", "weight below 0", low=0.0)
register_metric(r"attn/first_mass", "weight on the first key", **_FRACTION)
register_metric(r"attn/logit_std", "std of a row's logits", low=0.0)
register_metric(r"attn/logit_max", "largest logit")
register_metric(r"attn/attn_distance", "mean |i − j| attended", unit="tokens", low=0.0)
# what the heads do (attnlab.heads): head-type scores on the repeated-token probe, dilution, rank collapse, importance
register_metric(r"attn/prev_token(_max)?", "weight on the previous token", **_FRACTION)
register_metric(r"attn/duplicate(_max)?", "weight on earlier copies of the token", **_FRACTION)
register_metric(r"attn/induction(_max)?", "weight on the token after an earlier copy", **_FRACTION)
register_metric(r"attn/local(_max)?", "weight within ±w of the query", **_FRACTION)
register_metric(r"attn/near_mass", "weight on the nearest k keys", **_FRACTION)
register_metric(r"attn/locality", "near weight ÷ a uniform row's", low=0.0)
register_metric(r"attn/rank_residual(_attn)?", "‖X − 1x̄ᵀ‖ / ‖X‖ (rank collapse)", low=0.0)
register_metric(r"attn/importance", "head importance |∂L/∂ξ|", low=0.0)
register_metric(r"prune/auc_\w+", "mean test metric over the pruning curve", low=0.0)
# compute (summary.json's fields, schema 5; Run.final reads them, state_size summed over the layers)
register_metric(r"params", "trainable parameters", low=0.0, si=True)
register_metric(r"params_non_embedding", "parameters but the embeddings", low=0.0, si=True)
register_metric(r"flops_per_token", "training FLOPs per token", unit="FLOPs", low=0.0, si=True)
register_metric(r"state_size", "state per sequence, all layers", unit="floats", low=0.0, si=True)
register_metric(r"tokens_per_step", "tokens per step", unit="tokens", low=0.0, si=True)
register_metric(r"tokens_seen", "tokens seen in training", unit="tokens", low=0.0, si=True)
register_metric(r"step_time_s", "median step time", unit="s", low=0.0)
register_metric(r"wall_time_s", "wall time", unit="s", low=0.0)

# where each metric the runs log is listed, in this order (a view lists its metrics in the order of these calls)
show_metric("val/acc_best", "final", "csv")
show_metric("val/loss", "csv")
show_metric("test/acc", "final", "csv", "length", "pareto")
show_metric("test/loss", "final", "csv", "length")
show_metric("test/bpc", "final", "csv", "length", "pareto")
show_metric("val/bpc", "final")
show_metric("train/loss", "curve")
show_metric("train/acc")
show_metric("val/acc", "curve")
show_metric("attn/entropy_norm", "final", "init", "curve", "head", "table", "csv", short="ent_n")
show_metric("attn/saturation", "final", "init", "curve", "head", "table", "csv", short="sat")
show_metric("attn/max_prob", "final", "init", "csv")
show_metric("attn/logit_std", "final", "init", "csv")
show_metric("attn/attn_distance", "final", "csv")
show_metric("attn/first_mass", "final", "csv")
show_metric("attn/negative_mass", "final", "csv")
show_metric("attn/row_mass", "final", "csv")
show_metric("attn/support", "final", "csv")
show_metric("attn/logit_max", "init", "csv")
show_metric("attn/entropy")
show_metric("attn/induction_max", "final", "curve", "csv")
show_metric("attn/prev_token_max", "final", "csv")
show_metric("attn/duplicate_max", "csv")
show_metric("attn/local_max", "csv")
show_metric("attn/locality", "final", "csv")
show_metric("attn/near_mass", "csv")
show_metric("attn/rank_residual", "final", "csv")
show_metric("attn/rank_residual_attn", "csv")
show_metric("prune/auc_importance", "final", "csv")
show_metric("prune/auc_random", "final", "csv")
show_metric("attn/prev_token")
show_metric("attn/duplicate")
show_metric("attn/induction", "head")
show_metric("attn/local")
show_metric("attn/importance")
show_metric("train/plateau_steps", "final", "csv")
show_metric("train/steps_to_99", "final", "csv")
show_metric("params_non_embedding", "compute")
show_metric("flops_per_token", "cost", "compute", "terminal", short="FLOPs/tok")
show_metric("params", "cost")  # (params, state_size and wall_time_s have CSV columns of their own)
show_metric("state_size", "cost")
show_metric("wall_time_s", "cost")
show_metric("tokens_seen", "compute")
show_metric("step_time_s", "compute")

_LENGTH = re.compile(r"^(?P<base>.+)@(?P<length>\d+)$")
_HEAD = re.compile(r"^attn/L(?P<layer>\d+)H(?P<head>\d+)/(?P<stat>\w+)$")
_LAYER = re.compile(r"^attn/L(?P<layer>\d+)/(?P<stat>\w+)$")


def plain_number(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits, as ``format(value, "g")`` but never in exponent notation for
    1e-4 <= |value| < 1e6 (``123``, ``1234``, ``0.0123``; the integer part is never rounded away)."""
    if not math.isfinite(value) or value == 0:
        return f"{value:g}"
    magnitude = math.floor(math.log10(abs(value)))
    if magnitude < -4 or magnitude >= 6:
        return f"{value:.{digits}g}"
    text = f"{value:.{max(digits - 1 - magnitude, 0)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def si_number(value: float, digits: int = 3) -> str:
    """``value`` with an SI prefix from 1000 on (``705k``, ``1.2M``, ``3.4G``; at most ``P``), ``digits``
    significant digits; :func:`plain_number` below 1000."""
    if not math.isfinite(value) or abs(value) < 1000:
        return plain_number(value, digits)
    power = min(15, 3 * (math.floor(math.log10(abs(value))) // 3))
    scaled = float(f"{value / 10**power:.{digits}g}")
    if abs(scaled) >= 1000 and power < 15:  # 999,950 rounds to 1000k: 1M
        power += 3
        scaled = float(f"{value / 10**power:.{digits}g}")
    return f"{plain_number(scaled, digits)}{_PREFIX[power]}"


_PREFIX = {3: "k", 6: "M", 9: "G", 12: "T", 15: "P"}


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
