"""Statistics over seeds, and how a metric's values and intervals are written: the bottom of attnlab's analysis.

Training's terminal reports (the tuned sweeper's table, :mod:`attnlab.training.tuned`), the dashboard
(:mod:`attnlab.dashboard`) and the card (:mod:`attnlab.card`) print the same numbers the same way from here; this
module imports nothing of attnlab, so that training never imports the dashboard (these names' old paths in
:mod:`attnlab.dashboard.stats`, :mod:`attnlab.dashboard.metrics`, :mod:`attnlab.dashboard.load` and
:mod:`attnlab.dashboard.tuned` read through :mod:`attnlab.compat` until 1.0).

* **Intervals and tests**: every interval in attnlab is the mean over seeds ± the half-width
  ``t_{0.975, n-1} · s / sqrt(n)`` (:func:`mean_ci`; sample standard deviation ``s``, ``n`` seeds; none with one
  seed). Two configurations are compared paired over the seeds both ran (:func:`paired_difference`), else with
  Welch's unpaired test (:func:`welch_difference`), and several comparisons are corrected with Holm's step-down
  method (:func:`holm`). Quantiles and p-values come from ``scipy.stats.t`` (:func:`t_critical`,
  :func:`t_two_sided_p`). The formulas are spelt out in :mod:`attnlab.dashboard.stats`, which applies them to runs.
* **Metric specs**: a logged name (``test/acc``, ``attn/L1H0/saturation``, ``test/acc@64``: :func:`parse_metric`)
  picks a :class:`MetricSpec` from the first family whose pattern matches its base name (:func:`spec_for`): unit,
  range, direction, percentage or not. A new family is one :func:`register_spec` call (the dashboard's
  :func:`~attnlab.dashboard.metrics.register_metric` also lists it in its views).
* **Text**: :func:`interval_text` writes one interval as every report prints it: ``87.5 % ± 1.2 (n=3)``, or
  ``± > 100`` where the half-width is at least the metric's whole range, never both.
* **Tuned sweeps**: :func:`grid_edges`, whether a chosen grid point lies at the grid's edge (one rule for the
  terminal, ``tuned.json`` and the page).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import t as student_t

__all__ = [
    "Difference",
    "MetricSpec",
    "finite",
    "grid_edges",
    "half_width_text",
    "holm",
    "interval_text",
    "mean_ci",
    "paired_difference",
    "parse_metric",
    "plain_number",
    "register_spec",
    "si_number",
    "spec_for",
    "t_critical",
    "t_two_sided_p",
    "welch_difference",
]


# ---------------------------------------------------------------------------------------------------- numbers


def finite(value: Any) -> float | None:
    """``value`` as a float, or None for null / NaN / inf / booleans / non-numbers."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond a float (``1e400`` written out)
        return None
    return x if math.isfinite(x) else None


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


# ---------------------------------------------------------------------------------------------------- metric specs


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


def register_spec(pattern: str, title: str, **spec: Any) -> MetricSpec:
    """Register how to show the metrics whose base name fully matches the regular expression ``pattern`` (families
    registered later take precedence): a :class:`MetricSpec` with ``title`` and ``spec``'s fields. Returns it."""
    made = MetricSpec(title=title, **spec)
    _FAMILIES.insert(0, (re.compile(pattern), made))
    return made


_FRACTION = {"low": 0.0, "high": 1.0}
# registered from the most general to the most specific (the last registered is tried first)
register_spec(r".*", "value")
register_spec(r".*/acc(_best)?", "accuracy", unit="%", percent=True, higher_is_better=True, chance=True, **_FRACTION)
register_spec(r".*/loss", "cross-entropy", unit="nats", low=0.0, higher_is_better=False)
register_spec(r".*/bpc", "bits per byte", unit="bits/byte", low=0.0, higher_is_better=False)
register_spec(r"train/(plateau_steps|steps_to_99)", "steps to reach", unit="steps", low=0.0, higher_is_better=False)
register_spec(r"attn/entropy", "attention entropy", unit="nats", low=0.0)
register_spec(r"attn/entropy_norm", "entropy / log(keys)", **_FRACTION)
register_spec(r"attn/saturation", "rows with max weight > 0.99", unit="fraction", **_FRACTION)
register_spec(r"attn/max_prob", "max attention weight", **_FRACTION)
register_spec(r"attn/support", "keys with weight ≠ 0", unit="fraction", **_FRACTION)
register_spec(r"attn/row_mass", "sum of a row's weights", low=0.0)
register_spec(r"attn/negative_mass", "weight below 0", low=0.0)
register_spec(r"attn/first_mass", "weight on the first key", **_FRACTION)
register_spec(r"attn/leftover", "stick left over (1 − row sum)", **_FRACTION)
register_spec(r"attn/signed", "layers with signed weights (no entropy)", unit="fraction", **_FRACTION)
register_spec(r"attn/logit_std", "std of a row's logits", low=0.0)
register_spec(r"attn/logit_max", "largest logit")
register_spec(r"attn/attn_distance", "mean |i − j| attended", unit="tokens", low=0.0)
# what the heads do (attnlab.heads): head-type scores on the repeated-token probe, dilution, rank collapse, importance
register_spec(r"attn/prev_token(_max)?", "weight on the previous token", **_FRACTION)
register_spec(r"attn/duplicate(_max)?", "weight on earlier copies of the token", **_FRACTION)
register_spec(r"attn/induction(_max)?", "weight on the token after an earlier copy", **_FRACTION)
register_spec(r"attn/local(_max)?", "weight within ±w of the query", **_FRACTION)
register_spec(r"attn/near_mass", "weight on the nearest k keys", **_FRACTION)
register_spec(r"attn/locality", "near weight ÷ a uniform row's", low=0.0)
register_spec(r"attn/act_max", "largest |activation| in the residual stream", low=0.0, higher_is_better=False)
register_spec(r"attn/rank_residual(_attn)?", "‖X − 1x̄ᵀ‖ / ‖X‖ (rank collapse)", low=0.0)
register_spec(r"attn/importance", "head importance |∂L/∂ξ|", low=0.0)
register_spec(r"prune/auc_\w+", "mean test metric over the pruning curve", low=0.0)
# compute (summary.json's fields, schema 5; Run.final reads them, state_size summed over the layers)
register_spec(r"params", "trainable parameters", low=0.0, si=True)
register_spec(r"params_non_embedding", "parameters but the embeddings", low=0.0, si=True)
register_spec(r"flops_per_token", "training FLOPs per token", unit="FLOPs", low=0.0, si=True)
register_spec(r"state_size", "state per sequence, all layers", unit="floats", low=0.0, si=True)
register_spec(r"tokens_per_step", "tokens per step", unit="tokens", low=0.0, si=True)
register_spec(r"tokens_seen", "tokens seen in training", unit="tokens", low=0.0, si=True)
register_spec(r"step_time_s", "median step time", unit="s", low=0.0)
register_spec(r"wall_time_s", "wall time", unit="s", low=0.0)

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


# ---------------------------------------------------------------------------------------------------- over seeds


@functools.lru_cache(maxsize=256)
def t_critical(df: int) -> float:
    """The two-sided 95 % Student-t quantile ``t_{0.975, df}`` (``scipy.stats.t.ppf``)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return float(student_t.ppf(0.975, df))


def mean_ci(values: Iterable[float | None]) -> tuple[float, float | None, int]:
    """(mean, 95 % CI half-width, n) of the finite ``values``: half-width = t_{0.975, n-1} * s / sqrt(n) with the
    sample standard deviation s; None when n < 2. The mean is NaN when there is no finite value."""
    xs = np.asarray([v for v in (finite(v) for v in values) if v is not None], dtype=float)
    n = int(xs.size)
    if n == 0:
        return math.nan, None, 0
    mean = float(xs.mean())
    if n < 2:
        return mean, None, n
    return mean, t_critical(n - 1) * float(xs.std(ddof=1)) / math.sqrt(n), n


def _t_quantile(df: float) -> float:
    """``t_{0.975, df}`` for a real ``df`` (Welch's)."""
    return float(student_t.ppf(0.975, df))


def t_two_sided_p(t: float, df: float) -> float:
    """The two-sided p-value ``P(|T_df| >= |t|)`` of Student's t with ``df`` degrees of freedom (``df`` may be
    real: Welch's): ``2 · scipy.stats.t.sf(|t|, df)``. 0 for an infinite ``t`` (a difference with no spread), NaN
    for NaN."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0
    return float(min(1.0, 2.0 * student_t.sf(abs(t), df)))


def half_width_text(half_width: float, spec: MetricSpec) -> str:
    """``± 1.2``: the 95 % half-width in the metric's display unit (points for a percentage), or ``± > 100`` where
    it is at least the metric's whole range (the interval says nothing; :meth:`MetricSpec.format_half`)."""
    return f"± {spec.format_half(half_width)}"


def interval_text(mean: float, half_width: float | None, spec: MetricSpec | str, n: int | None = None) -> str:
    """One interval as every report prints it, page and terminal alike: ``87.5 % ± 1.2 (n=3)``; ``50.0 % ± > 100
    (n=2)`` where the half-width is at least the metric's range (never the number as well); ``87.5 % (n=1)`` without
    an interval. ``spec``: the metric's :class:`MetricSpec` or its name; ``n`` left out when None."""
    spec = spec_for(spec) if isinstance(spec, str) else spec
    text = spec.format(mean)
    if half_width is not None:
        text += f" {half_width_text(half_width, spec)}"
    return text if n is None else f"{text} (n={n})"


@dataclass(frozen=True)
class Difference:
    """The difference ``a − b`` of two configurations' values over seeds, with its 95 % t interval and test.

    Attributes:
        mean: the mean difference: over the common seeds of ``d_i = a_i − b_i`` (paired), else ``ā − b̄``.
        half_width: the interval's half-width (None when untestable: fewer than 2 pairs, or fewer than 2 values on
            a side for Welch).
        n: the pairs (paired), or ``n_a + n_b`` (Welch).
        df: the t test's degrees of freedom (``n − 1``, or Welch-Satterthwaite's); None when untestable.
        t: the t statistic ``mean / se`` (±inf for a nonzero difference with no spread); None when untestable.
        p: the two-sided p-value of the t test; None when untestable.
        paired: whether the values were paired by seed.
    """

    mean: float
    half_width: float | None
    n: int
    df: float | None = None
    t: float | None = None
    p: float | None = None
    paired: bool = True

    @property
    def tested(self) -> bool:
        """Whether there was enough data for an interval and a test."""
        return self.p is not None


def _ratio(mean: float, se: float) -> float:
    if se > 0:
        return mean / se
    return math.copysign(math.inf, mean) if mean != 0 else 0.0


def paired_difference(a: Mapping[Any, float], b: Mapping[Any, float]) -> Difference:
    """The paired difference of two configurations' values by seed (``{seed: value}``), over the seeds in both:
    mean ``d̄`` of ``d_i = a_i − b_i``, half-width ``t_{0.975, n−1} · s_d / sqrt(n)``, ``t = d̄ / (s_d / sqrt(n))``,
    two-sided ``p`` with ``n − 1`` df. Without a common seed it is :func:`welch_difference` of all the values."""
    common = [seed for seed in a if seed in b]
    if not common:
        return welch_difference(list(a.values()), list(b.values()))
    d = np.asarray([a[seed] - b[seed] for seed in common], dtype=float)
    n = int(d.size)
    mean = float(d.mean())
    if n < 2:
        return Difference(mean, None, n, paired=True)
    se = float(d.std(ddof=1)) / math.sqrt(n)
    t = _ratio(mean, se)
    p = t_two_sided_p(t, n - 1)
    return Difference(mean, t_critical(n - 1) * se, n, n - 1, t, p, paired=True)


def welch_difference(a: Sequence[float], b: Sequence[float]) -> Difference:
    """The unpaired difference ``ā − b̄`` with Welch's interval and test: ``se² = s_a²/n_a + s_b²/n_b``,
    Welch-Satterthwaite ``df = se⁴ / ((s_a²/n_a)²/(n_a−1) + (s_b²/n_b)²/(n_b−1))`` (``n_a + n_b − 2`` when neither
    side has any spread), half-width ``t_{0.975, df} · se``. Untested (no interval) when a side has fewer than 2
    values; the mean is NaN when a side has none."""
    xa, xb = np.asarray(list(a), dtype=float), np.asarray(list(b), dtype=float)
    na, nb = int(xa.size), int(xb.size)
    if na == 0 or nb == 0:
        return Difference(math.nan, None, na + nb, paired=False)
    mean = float(xa.mean() - xb.mean())
    if na < 2 or nb < 2:
        return Difference(mean, None, na + nb, paired=False)
    va, vb = float(xa.var(ddof=1)) / na, float(xb.var(ddof=1)) / nb
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1)) if va + vb > 0 else float(na + nb - 2)
    t = _ratio(mean, se)
    p = t_two_sided_p(t, df)
    return Difference(mean, _t_quantile(df) * se, na + nb, df, t, p, paired=False)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of ``m`` p-values, in their order: with the p-values sorted ascending
    ``p_(1) <= ... <= p_(m)``, ``p̃_(i) = max_{j<=i} min(1, (m − j + 1) · p_(j))``. Rejecting where ``p̃ < α``
    keeps the family-wise error rate at most ``α``."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):  # rank = j - 1
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


# ---------------------------------------------------------------------------------------------------- tuned sweeps


def grid_edges(grid: dict[str, list[Any]], best: dict[str, Any] | None) -> list[str]:
    """The keys of ``grid`` at whose smallest or largest value the point ``best`` lies: numeric keys (numbers, not
    booleans) with at least two distinct values in the grid, ``best``'s value equal to their minimum or maximum (the
    best may lie beyond: widen the grid there). Empty for no point. The tuned sweeper writes it into tuned.json with
    this function; older files lack it, so the page computes it."""
    if not best:
        return []
    out = []
    for key, values in grid.items():
        numbers = {float(v) for v in values if _number(v)}
        chosen = best.get(key)
        if len(numbers) >= 2 and all(_number(v) for v in values) and _number(chosen):
            if float(chosen) in (min(numbers), max(numbers)):
                out.append(key)
    return out


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
