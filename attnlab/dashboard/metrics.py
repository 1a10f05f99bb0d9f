"""How the dashboard draws a metric: a registry of metric families keyed by a name pattern.

A run logs flat names (``test/acc``, ``attn/entropy_norm``, ``test/acc@64``, ``attn/L1H0/saturation``). The
naming convention splits them into a *base* name and where it was measured:

* ``<base>@<L>``            the metric on the extra test set of length ``L`` (drawn against ``L``);
* ``attn/L<l>H<h>/<stat>``  one head of one layer (drawn as a layer × head heatmap);
* ``attn/L<l>/<stat>``      one layer's mean (listed in the CSV only);
* anything else             one number per run (drawn against the swept keys).

The base name picks a :class:`~attnlab.stats.MetricSpec` from the first family whose pattern matches it: the axis
title and unit, the range that intervals are clipped to, which direction is better, whether the task's chance
accuracy is drawn, and whether the value is shown as a percentage. A metric that no family names still gets drawn,
with a plain spec; a new family is one :func:`register_metric` call, and every chart, table and CSV column picks it
up. The specs, their families and :func:`~attnlab.stats.spec_for` live in :mod:`attnlab.stats` (training's terminal
reports use them too); this module adds where the dashboard lists each metric.

Where a metric is listed by name (the page's views, the terminal table, the CSV columns) is registered here too:
:func:`show_metric` puts a logged name in some of the :data:`VIEWS`, in the order of the calls, and
:func:`metrics_in` lists a view's metrics; the page and the CLI hold no list of their own. A logged metric that
no :func:`show_metric` call names still appears in the final-metrics charts (a ``test/``, ``val/`` or ``attn/``
name, after the listed ones), as it did before it was registered."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnlab.compat import forward
from attnlab.registry import unknown_name_message
from attnlab.stats import register_spec

if TYPE_CHECKING:
    from attnlab.stats import MetricSpec

__all__ = [
    "VIEWS",
    "listed_metrics",
    "metrics_in",
    "register_metric",
    "short_name",
    "show_metric",
]

# the specs and their families lived here before attnlab.stats (training prints intervals too, and never imports the
# dashboard): they read through attnlab.compat's table, each with a DeprecationWarning
__getattr__ = forward(__name__)


VIEWS: dict[str, str] = {
    "final": "the final-metrics charts, after the headline's metrics",
    "init": "the step-0 diagnostics ('At initialisation')",
    "curve": "the training curves",
    "validation": "the validation curves of every configuration on one shared axis (one panel per metric)",
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
    (families registered later take precedence; :func:`attnlab.stats.register_spec`). Returns the spec.

    ``views``: for a family that is one metric (``pattern`` a plain name such as ``attn/my_stat``), also list it
    in these :data:`VIEWS` (:func:`show_metric`)."""
    if views is not None and re.escape(pattern) != pattern:
        raise ValueError(f"views=... lists one metric by name; {pattern!r} is a pattern (use show_metric per name)")
    made = register_spec(pattern, title, **spec)
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


# the families of metric specs (units, ranges, directions) are registered in attnlab.stats, below training too

# where each metric the runs log is listed, in this order (a view lists its metrics in the order of these calls)
show_metric("val/acc_best", "final", "csv")
show_metric("val/loss", "csv", "validation")
show_metric("test/acc", "final", "csv", "length", "pareto")
show_metric("test/loss", "final", "csv", "length")
show_metric("test/bpc", "final", "csv", "length", "pareto")
show_metric("val/bpc", "final", "validation")
show_metric("train/loss", "curve")
show_metric("train/acc")
show_metric("val/acc", "curve", "validation")
show_metric("attn/entropy_norm", "final", "init", "curve", "head", "table", "csv", short="ent_n")
show_metric("attn/saturation", "final", "init", "curve", "head", "table", "csv", short="sat")
show_metric("attn/max_prob", "final", "init", "csv")
show_metric("attn/logit_std", "final", "init", "csv")
show_metric("attn/attn_distance", "final", "csv")
show_metric("attn/first_mass", "final", "csv")
show_metric("attn/negative_mass", "final", "csv")
show_metric("attn/signed", "csv")  # the fraction of the layers whose weights are signed: a setting, never charted
show_metric("attn/row_mass", "final", "csv")
show_metric("attn/leftover", "final", "csv")
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
show_metric("attn/act_max", "final", "csv")
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
