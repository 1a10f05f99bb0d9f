"""The HTML page: the headline first, then the charts, the attention views and the runs table.

The page is one self-contained file that opens from disk with no network: plotly.js (about 4.6 MB, most of the
page) is embedded once, figures are JSON drawn by ``page.js``, images are data URIs, and a Content-Security-Policy
forbids every request. One copy of plotly.js per page is the price of a file that can be mailed or archived alone;
a folder of sweeps makes one page (one copy) for all of them.

Every name from a run (variant, run folder, config values) is HTML-escaped in the page and written to the JSON
with ``<``, ``>`` and ``&`` as ``\\u`` escapes, so a variant named ``<script>...`` shows as text and never runs.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from typing import Any

import attnlab.dashboard.figures as figures
from attnlab.dashboard.dims import Dimension, Sweep, attribute_name, format_value
from attnlab.dashboard.heads import TYPE_COLOURS, atlas_figure, pruning_figure, rank_figure
from attnlab.dashboard.load import Run, natural_key
from attnlab.dashboard.metrics import listed_metrics, metrics_in
from attnlab.dashboard.stats import ALPHA, Headline, best_run, best_runs, grouped, headline
from attnlab.dashboard.tuned import Tuned, TunedSweep, find_tuned
from attnlab.heads import HEAD_THRESHOLD, HEAD_TYPES
from attnlab.runs import RunFileError, read_bytes
from attnlab.stats import half_width_text, parse_metric, spec_for

__all__ = ["CSP", "Empty", "Options", "build_html", "format_time", "headline_metrics", "page_metrics"]

CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
    "font-src data:; connect-src 'none'"
)
MAX_SELECTOR_RUNS = 12  # runs per variant offered in the per-head selector (best first)
MAX_MAP_RUNS = 4  # runs per variant offered in the attention-map selector (images are most of a page's size)
MAX_IMAGE_BYTES = 2_000_000
SEARCH_MIN_VALUES = 5  # a numeric key with this many distinct values makes the page show the search view


@dataclass(frozen=True)
class Options:
    """What the page compares: ``x`` the main key (headline columns, charts' x axis), ``facet`` the key split into
    panels (``"none"`` for none), ``metric`` the headline metric (default: the one the runs' task declares,
    :attr:`~attnlab.dashboard.load.Run.headline_metric`), ``config_keys`` the keys that define a configuration
    (default: found, :class:`~attnlab.dashboard.dims.Sweep`; every other varying key is then an attribute)."""

    x: str | None = None
    facet: str | None = None
    metric: str | None = None
    config_keys: tuple[str, ...] | None = None


class Empty(str):
    """A section's body when it has nothing to show: the page writes it as one line (its heading and why), not as
    a heading over an empty section."""

    __slots__ = ()


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _json(value: Any) -> str:
    """JSON safe inside a ``<script>`` element (no ``<``, ``>`` or ``&`` left) and without NaN."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False, default=_plain_number)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _plain_number(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to the page")


def _clean(value: Any) -> Any:
    """NaN and infinities as null, recursively (plotly reads null as a gap)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _asset(name: str) -> str:
    return resources.files("attnlab.dashboard").joinpath(name).read_text(encoding="utf-8")


class _Page:
    """Collects figures and their JSON while the sections are written."""

    def __init__(self) -> None:
        self.scripts: list[str] = []
        self.count = 0

    def figure(self, fig: dict[str, Any], div_id: str | None = None) -> str:
        self.count += 1
        div_id = div_id or f"fig-{self.count}"
        self.scripts.append(f'<script type="application/json" id="{div_id}-json">{_json(_clean(fig))}</script>')
        return f'<div class="plot" id="{div_id}" data-figure="{div_id}-json"></div>'

    def data(self, data_id: str, value: Any) -> None:
        self.scripts.append(f'<script type="application/json" id="{data_id}">{_json(_clean(value))}</script>')


def declared_metrics(runs: Sequence[Run]) -> list[str]:
    """The headline metrics that the finished runs' tasks declare (:attr:`Run.headline_metric`: ``test/acc``,
    ``test/bpc``, ``test/acc@256`` for a state-tracking task with test lengths), the most common first."""
    return [m for m, _ in Counter(r.headline_metric for r in runs if r.ok).most_common()]


def optimized_metric(runs: Sequence[Run]) -> str:
    """The runs' most common ``optimized_metric`` (what a sweeper optimises), else ``val/acc_best``."""
    named = Counter(r.optimized_metric for r in runs if r.optimized_metric)
    return named.most_common(1)[0][0] if named else "val/acc_best"


def headline_metrics(runs: Sequence[Run], chosen: str | None = None) -> list[str]:
    """The headline's metrics: ``chosen`` (``--metric``), else those the runs' tasks declare
    (:func:`declared_metrics`); then the runs' most common ``optimized_metric`` (else ``val/acc_best``) and
    ``test/acc`` where they differ; only those some finished run reports. The first is *the* headline."""
    first = [chosen] if chosen is not None else declared_metrics(runs)
    candidates = dict.fromkeys([*first, optimized_metric(runs), "test/acc"])
    return [m for m in candidates if any(r.final(m) is not None for r in runs if r.ok)]


def page_metrics(runs: Sequence[Run], first: Sequence[str]) -> list[str]:
    """The final metrics to chart: ``first`` (the headline's), then those of the ``final`` view
    (:func:`~attnlab.dashboard.metrics.metrics_in`) that some finished run reports, in their registered order, then
    any other test / val / attention metric some finished run reports that no
    :func:`~attnlab.dashboard.metrics.show_metric` names (attention first, by name). Scalar names only: ``@L`` and
    per-head names have their own views."""
    names = set()
    for run in runs:
        if run.ok:
            names.update(n for n in run.metric_names if parse_metric(n)[0] == "scalar")
    present = {n for n in names if any(r.final(n) is not None for r in runs if r.ok)}
    listed = [n for n in metrics_in("final") if n in present]
    known = set(listed_metrics())
    unlisted = (n for n in present if n not in known and n.startswith(("test/", "val/", "attn/")))
    rest = [*listed, *sorted(unlisted, key=lambda n: (not n.startswith("attn/"), n))]
    return [*first, *[n for n in rest if n not in first]]


# ---------------------------------------------------------------------------------------------------- sections
def _header(runs: Sequence[Run], sweep: Sweep, title: str, source: str) -> str:
    counts = Counter(r.status for r in runs)
    status = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    seeds = Counter(len({r.seed for r in members}) for _, _, members in grouped(runs, sweep, sweep.dims))
    replicate = ", ".join(f"{k} seed{'s' if k != 1 else ''} × {v}" for k, v in sorted(seeds.items()))
    labelled = sweep.label_dims(sweep.dims)
    dims = " · ".join(f"<b>{_e(d.name)}</b> ({len(d.values)})" for d in labelled) or "nothing (one configuration)"
    preset = [d.name for d in labelled if d.key in sweep.preset_keys]
    if preset:
        dims += (
            f" ({_e(', '.join(preset))}: set by each model's preset and changed on some run's command line, so it "
            "tells those runs apart; never the main key)"
        )
    knobs = [d for d in sweep.dims if d not in labelled]
    also = (
        "; also different, left out of labels (how the runs were trained and evaluated, not what; see the runs "
        f"table): <code>{_e(' · '.join(f'{d.name} ({len(d.values)})' for d in knobs))}</code>"
        if knobs
        else ""
    )
    parts = [
        f"<h1>{_e(title)}</h1>",
        f'<p class="meta">{_e(source)} · {len(runs)} runs ({_e(status)}) · generated '
        f"{datetime.now().strftime('%Y-%m-%d %H:%M')}</p>",
        f'<p class="meta">Compared: {dims}{also}; configurations: {_e(replicate)}. Every point and cell is the '
        "mean over seeds with its 95 % t interval (none for one seed).</p>",
    ]
    parts += _attributes_html(sweep)
    main, rest = sweep.constants_text()
    if main or rest:
        more = (
            f' <details style="display:inline"><summary>{len(rest)} more</summary><code>{_e(" · ".join(rest))}'
            "</code></details>"
            if rest
            else ""
        )
        parts.append(f'<p class="meta">The same in every run: <code>{_e(" · ".join(main))}</code>{more}</p>')
    if any(r.summary and r.summary.get("smoke") for r in runs):
        parts.append(
            '<p class="meta smoke">Smoke runs (<code>debug=fast</code>): a handful of steps on tiny data show that '
            "the configurations run; their numbers are no result.</p>"
        )
    return "\n".join(parts)


def _attributes_html(sweep: Sweep) -> list[str]:
    """The header's lines on what is no dimension: each model's attributes (the keys its preset sets, as
    ``kda: normalizer=none · short_conv=4``; :meth:`Sweep.attribute_keys`), and with ``--config-keys`` the keys
    pooled into each configuration whatever their value."""
    parts = []
    keys = sweep.attribute_keys()
    owners = list(dict.fromkeys(sweep.derived[k] for k in keys))
    for owner in owners:
        dim = next((d for d in sweep.dims if d.key == owner), None)
        if dim is None:
            continue
        mine = [k for k in keys if sweep.derived[k] == owner]
        shown = []
        for value in dim.values:
            members = [run for run in sweep.runs if sweep.key_of(run, [dim]) == (value,)]
            text = sweep.attributes_text(members, mine)
            if text:
                shown.append(f"<b>{_e(dim.format(value))}</b>: {_e(text)}")
        if shown:
            what = "model" if owner == "variant.name" else dim.name
            parts.append(
                f'<p class="meta attrs">Attributes of each {_e(what)} (set by its preset or its comparison, not by a '
                f"command line: not a dimension, never the main key): {'; '.join(shown)}</p>"
            )
    if sweep.pooled:
        pooled = " · ".join(
            f"{attribute_name(k)} ({', '.join(format_value(v) for v in vs)})" for k, vs in sweep.pooled.items()
        )
        given = ", ".join(sweep.config_keys or ())
        parts.append(
            f'<p class="meta warn">Pooled: with --config-keys {_e(given)}, runs that differ only in '
            f"<code>{_e(pooled)}</code> are one configuration (their seeds pool into one mean).</p>"
        )
    return parts


def _params_text(params: Sequence[int]) -> str:
    """A cell's parameter count (its runs': equal across seeds), or their range where they differ; "-" for none."""
    if not params:
        return "-"
    low, high = min(params), max(params)
    return f"{low:,}" if low == high else f"{low:,}–{high:,}"


def _rivals_html(table: Headline) -> str:
    """The winner against each other configuration at its value of the main key: the difference (paired over the
    common seeds, else Welch's) ± its 95 % half-width, the seeds, the p-value and the Holm-adjusted one."""
    comps = table.comparisons()
    if not comps or not any(c.difference.tested for c in comps):
        return ""
    spec = table.spec
    won = table.winner()
    assert won is not None  # (comparisons() is empty without one)
    unit = "points" if spec.percent else spec.unit
    rows = []
    for c in comps:
        d = c.difference
        margin = f"{100 * d.mean:.1f}" if spec.percent else spec.format(d.mean)
        half = "" if d.half_width is None else f" {half_width_text(d.half_width, spec)}"
        test = f"paired, {d.n} seed{'s' if d.n != 1 else ''}" if d.paired else "Welch (no common seed)"
        p = "-" if d.p is None else f"{d.p:.2g}"
        verdict = "beats" if c.wins else "untested" if not d.tested else "not separated"
        cls = ' class="win"' if c.wins else ""
        rows.append(
            f'<tr{cls}><td class="t">{_e(c.label)}</td><td>{_e(margin + half)}</td><td class="t">{_e(test)}</td>'
            f'<td>{_e(p)}</td><td>{_e(f"{c.p_holm:.2g}")}</td><td class="t">{_e(verdict)}</td></tr>'
        )
    caption = (
        f"{table.method(comps)[0].upper()}{table.method(comps)[1:]}: the winner, {table.row_label(won[0])}, "
        f"minus each rival{' at ' + table.column_label(won[1]) if table.column is not None else ''}"
        f"{f' ({unit})' if unit else ''}, mean ± 95 % half-width over the seeds both ran (Welch's unpaired interval "
        f"where they share none); two-sided p, and Holm's step-down adjustment over the {len(comps)} comparisons; "
        f"it beats a rival when the adjusted p < {ALPHA:g}."
    )
    return (
        f'<div class="scroll"><table class="rivals" data-metric="{_e(table.metric)}"><caption>{_e(caption)}</caption>'
        f'<thead><tr><th class="t">vs</th><th>winner − rival{_e(f" ({unit})" if unit else "")}</th>'
        '<th class="t">test</th><th>p</th><th>Holm p</th><th class="t"></th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def _headline_html(table: Headline) -> str:
    spec = table.spec
    head = "".join(f"<th>{_e(table.column_label(c))}</th>" for c in table.columns)
    body = []
    for label, key in table.rows:
        cells = []
        for col in table.columns:
            cell = table.cells.get((key, col))
            if cell is None:
                cells.append("<td>-</td>")
                continue
            cls = ' class="best"' if table.is_best(key, col) else ""
            text = f"{spec.format(cell.mean)}{cell.half_text(spec)}"
            note = f'<span class="pt">at {_e(cell.note)}</span>' if cell.note else ""
            cells.append(
                f'<td{cls}>{_e(text)} <span class="n">({cell.n})</span>'
                f'<span class="p">{_e(_params_text(cell.params))} params</span>{note}</td>'
            )
        if table.attributes:  # (its own column: the row's name stays the configuration's)
            cells.append(f'<td class="t attr">{_e(table.attributes.get(key, ""))}</td>')
        body.append(f'<tr><td class="t">{_e(label)}</td>{"".join(cells)}</tr>')
    caption = (
        f"Cells: mean ± 95 % half-width ({'points' if spec.percent else spec.unit or 'units'}) over seeds, "
        "(n seeds), and the trainable parameters of the cell's runs (a range only where they differ); ★ the best "
        "in its column (every one of a tie)"
        + (
            " (higher is better)"
            if spec.higher_is_better
            else " (lower is better)"
            if spec.higher_is_better is False
            else ""
        )
        + "."
        + (" ± > 100: the interval is wider than the metric's whole range." if spec.percent else "")
        + (
            " Under each cell, the point its configuration was tuned to (its seed runs ran there)."
            if any(cell.note for cell in table.cells.values())
            else ""
        )
    )
    attr_head = '<th class="t attr">set by the model</th>' if table.attributes else ""
    return (
        f'<p class="verdict">{_e(table.sentence())}</p>'
        f'<div class="scroll"><table class="headline" data-metric="{_e(table.metric)}"><caption>{_e(caption)}</caption>'
        f'<thead><tr><th class="t">{_e(spec.axis_title(table.metric))}</th>{head}{attr_head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>" + _rivals_html(table)
    )


def _groups(runs: Sequence[Run], sweep: Sweep, tuned: Tuned) -> list[tuple[str, TunedSweep | None, list[Run], Sweep]]:
    """What the headline and the Pareto view compare, (title, tuned sweep, runs, sweep) each: every tuned sweep's
    seed runs (its tuning runs never pool into a cell), then the runs outside every tuned sweep with ``sweep``
    (theirs alone where some are tuned). Titles only where there are several groups."""
    out: list[tuple[str, TunedSweep | None, list[Run], Sweep]] = []
    for t in tuned.sweeps:
        group_sweep = t.sweep or Sweep(t.seed_runs, config_keys=sweep.config_keys, strict=False)
        out.append((f"Tuned sweep {t.name}", t, t.seed_runs, group_sweep))
    inside = {id(run) for t in tuned.sweeps for run in t.runs}
    rest = [run for run in runs if id(run) not in inside]
    if rest:
        out.append(
            ("Other runs (not tuned)", None, rest, sweep if not out else Sweep(rest, config_keys=sweep.config_keys))
        )
    return out if len(out) > 1 else [("", t, r, s) for _, t, r, s in out]


def _headline_note(metric: str, runs: Sequence[Run], chosen: str | None) -> str:
    """Where the headline metric comes from: ``--metric``, or the task that declares it (with what it is)."""
    if chosen is not None:
        return f"chosen with --metric (the runs' tasks declare {', '.join(declared_metrics(runs)) or 'none'})"
    tasks = sorted({r.task for r in runs if r.ok and r.headline_metric == metric}, key=natural_key)
    kind, base, where = parse_metric(metric)
    what = (
        f"the test accuracy at the longest test length, L={where['length']}, beyond the training length"
        if kind == "length" and base == "test/acc"
        else f"{base} at test length L={where['length']}"
        if kind == "length"
        else "its usual test metric"
    )
    return f"declared by the task ({', '.join(tasks) or 'the runs'}: {what}; --metric chooses another)"


def _tuned_html(tuned: TunedSweep) -> str:
    """The protocol of a tuned sweep in one sentence, and each configuration's chosen point."""
    spec = spec_for(tuned.metric)
    listed = sum(len(c.seeds) for c in tuned.configurations)
    found = len(tuned.seed_runs)
    reused = sum(job.reused and job.run is not None for c in tuned.configurations for job in c.seeds)
    tuning = len(tuned.tune_runs) - reused
    text = (
        f"Tuned sweep ({_e(tuned.name)}/tuned.json): {_e(tuned.protocol())}. The tables below use only the "
        f"{found} seed run{'s' if found != 1 else ''}"
        + (f" (of {listed} listed)" if found != listed else "")
        + f", each configuration at its own chosen point; the {tuning} other tuning run{'s' if tuning != 1 else ''}"
        " show in the tuning chart, not here."
    )
    if tuned.stage != "done":
        text += f" Unfinished: tuned.json is at stage {_e(tuned.stage)}."
    rows = []
    for c in tuned.ordered():
        job = c.best_job
        if c.best is not None:
            point = ", ".join(f"{k}={format_value(v)}" for k, v in c.best.items())
            edges = c.edges(tuned.grid)
            if edges:
                point += f" (at the grid's edge: widen it{'' if len(tuned.grid) == 1 else ' in ' + ', '.join(edges)})"
        elif c.tune and all(j.failed for j in c.tune):
            point = "every point failed"
        else:
            point = "not chosen yet"
        value = spec.format(job.value) if job is not None and job.value is not None else "-"
        done = sum(1 for s in c.seeds if s.run is not None and s.run.ok)
        seeds = ", ".join(str(s.seed) for s in c.seeds) or "-"
        rows.append(
            f'<tr><td class="t">{_e(c.label)}</td><td class="t">{_e(point)}</td><td>{_e(value)}</td>'
            f'<td class="t">{_e(seeds)} ({done} finished)</td></tr>'
        )
    head = (
        f'<th class="t">configuration</th><th class="t">chosen point</th><th>{_e(tuned.metric)} there (seed '
        f'{tuned.tune_seed})</th><th class="t">seed runs</th>'
    )
    return (
        f'<p class="protocol">{text}</p><div class="scroll"><table class="tuned" data-sweep="{_e(tuned.name)}">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
    )


def _not_distributions(runs: Sequence[Run], sweep: Sweep, metrics: Sequence[str]) -> str:
    """Sentences naming the configurations with layers whose weights are signed, which have no entropy-like
    statistic (:func:`~attnlab.dashboard.figures.signed_note`: the delta rule, RWKV-7, MTA, differential attention),
    and those whose attention rows are no distribution (:func:`~attnlab.dashboard.figures.unnormalised`: a row mass
    other than 1, or an older run's signed weights), where ``metrics`` draws an entropy-like statistic; "" when
    there are none."""
    drawn = [m for m in metrics if m.removeprefix("attn/") in figures.PROBABILITY_METRICS]
    if not drawn:
        return ""
    named = sweep.label_dims(sweep.dims)

    def shown(group: Sequence[Run]) -> str:
        labels = sorted({sweep.label(run, named) or run.name for run in group}, key=natural_key)
        return ", ".join(labels[:4]) + (f" and {len(labels) - 4} more" if len(labels) > 4 else "")

    text = ""
    signed = [run for run in runs if run.ok and figures.signed_note(run)]
    if signed:
        text += (
            f" No {_e(', '.join(drawn))} where the weights are signed (their rows are no distributions): "
            f"{_e(shown(signed))} ({_e(figures.signed_note(signed[0]))})."
        )
    odd = [run for run in runs if run.ok and figures.unnormalised(run)]
    if odd:
        text += (
            f" Not entropies of a distribution for {_e(shown(odd))}: their effective weights are signed or their rows "
            f"do not sum to 1 ({_e(figures.unnormalised(odd[0]))}), so {_e(', '.join(drawn))} are statistics of each "
            "row's nonnegative part renormalised to 1, not of the weights themselves."
        )
    return text


def _chance_note(runs: Sequence[Run]) -> str:
    """What the dashed chance line is, where a task's chance accuracy is not a uniform guess
    (:data:`~attnlab.dashboard.figures.CHANCE_NAMES`); "" otherwise."""
    tasks = sorted({run.task for run in runs if run.ok and run.chance is not None} & set(figures.CHANCE_NAMES))
    return "".join(
        f" The dashed line of {_e(task)} is {_e(figures.CHANCE_NAMES[task][0])}: {_e(figures.CHANCE_NAMES[task][1])}."
        for task in tasks
    )


def _pareto_inputs(runs: Sequence[Run]) -> tuple[list[str], list[str]]:
    """(metrics, costs) of the Pareto view for ``runs``: the headline metric the runs' tasks declare
    (:func:`declared_metrics`: ``test/acc@128`` for a state-tracking task), then the ``pareto`` view's metrics, those
    a finished run reports, two at most; and the ``cost`` view's quantities, or none unless some finished run
    reports each of them (runs before summary.json's schema 5 have no FLOPs: no view)."""
    ok = [r for r in runs if r.ok]
    costs = metrics_in("cost")
    if not ok or not all(any(r.final(c) is not None for r in ok) for c in costs):
        return [], []
    metrics = dict.fromkeys([*declared_metrics(ok), *metrics_in("pareto")])
    return [m for m in metrics if any(r.final(m) is not None for r in ok)][:2], costs


def _runs_table(runs: Sequence[Run], sweep: Sweep, metrics: Sequence[str]) -> str:
    """Sortable, one row per run: name, status, wall time, the varying keys, seed, params, state size (floats per
    sequence, summed over the layers) and a few metrics."""
    columns: list[tuple[str, str]] = [("run", "t name"), ("status", "t status"), ("wall time", "")]
    columns += [(d.name, "t" if not d.numeric else "") for d in sweep.dims]
    columns += [("seed", ""), ("params", ""), ("state", "")]
    columns += [(m, "") for m in metrics]
    header = "".join(f'<th class="{cls}" data-key="{_e(name)}">{_e(name)}</th>' for name, cls in columns)
    rows = []
    for run in runs:
        row_class = "ok" if run.ok else ("running" if run.status == "running" else "failed")
        reason = f' title="{_e(run.reason)}"' if run.reason and not run.ok else ""
        cells = [
            f'<td class="t name" data-v="{_e(run.name)}" title="{_e(run.path)}">{_e(run.name)}</td>',
            f'<td class="t status"{reason}>{_e(run.status)}</td>',
            f'<td data-v="{_e(run.wall_time_s if run.wall_time_s is not None else "")}">'
            f"{_e(format_time(run.wall_time_s))}</td>",
        ]
        for d in sweep.dims:
            value = run.value(d.key)
            sort = value if isinstance(value, int | float) and not isinstance(value, bool) else d.format(value)
            cells.append(f'<td class="{"" if d.numeric else "t"}" data-v="{_e(sort)}">{_e(d.format(value))}</td>')
        cells.append(f'<td data-v="{_e(run.seed if run.seed is not None else "")}">{_e(run.seed)}</td>')
        cells.append(f'<td data-v="{_e(run.params or "")}">{_e(f"{run.params:,}" if run.params else "-")}</td>')
        state = run.state_size
        cells.append(f'<td data-v="{_e(state or "")}">{_e(f"{state:,}" if state else "-")}</td>')
        for m in metrics:
            v = run.final(m)
            cells.append(f'<td data-v="{"" if v is None else v}">{_e(spec_for(m).format(v))}</td>')
        rows.append(f'<tr class="{row_class}">{"".join(cells)}</tr>')
    return (
        f'<table class="runs sortable" id="runs-table"><thead><tr>{header}</tr></thead>'
        f"<tbody>\n{chr(10).join(rows)}\n</tbody></table>"
    )


def format_time(seconds: float | None) -> str:
    """``12.5 s``, ``3m 07s``; ``-`` for None."""
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 120 else f"{int(seconds // 60)}m {int(seconds % 60):02d}s"


def _selector_label(run: Run, sweep: Sweep, metric: str) -> str:
    named = [d for d in sweep.label_dims(sweep.dims) if d is not sweep.dims[0]]  # (the first: the selector's group)
    settings = " · ".join(d.label(run.value(d.key)) for d in named)
    value = spec_for(metric).format(run.final(metric))
    return f"{settings + ' · ' if settings else ''}seed {run.seed} · {metric} {value} · {run.name}"


def _ranked(runs: Sequence[Run], metric: str, first: Any) -> dict[Any, list[Run]]:
    """The runs grouped by their value of the first key (the variant): finished runs best first by ``metric``,
    then the others (still running, failed: their diagnostics and maps show how far they got)."""
    ranked = best_runs(runs, metric, lambda r: r.value(first.key) if first else "all runs")
    for run in runs:
        key = run.value(first.key) if first else "all runs"
        if run not in ranked.setdefault(key, []):
            ranked[key].append(run)
    return ranked


def _run_figures(
    page: _Page, runs: Sequence[Run], sweep: Sweep, metric: str, make: Callable[[Run], Any], prefix: str
) -> list[str]:
    """One figure per value of the first key (the variant), drawn by ``make(run)`` (None: nothing to draw): the best
    run's by ``metric`` first, with a selector for up to :data:`MAX_SELECTOR_RUNS` of the others."""
    first = sweep.dims[0] if sweep.dims else None
    out = []
    for group, members in sorted(_ranked(runs, metric, first).items(), key=lambda kv: natural_key(kv[0])):
        figs: dict[str, Any] = {}
        labels = []
        for run in members:
            fig = make(run)
            if fig is not None:
                figs[str(len(figs))] = fig
                labels.append(_selector_label(run, sweep, metric))
            if len(figs) >= MAX_SELECTOR_RUNS:
                break
        if not figs:
            continue
        div = f"{prefix}-{len(page.scripts)}"
        name = first.label(group) if first else "all runs"
        options = "".join(f'<option value="{i}">{_e(label)}</option>' for i, label in enumerate(labels))
        page.data(f"{div}-choices", figs)
        out.append(
            f'<h3>{_e(name)}</h3><div class="pick"><label>run (best first by {_e(metric)}): <select '
            f'data-choices="{div}-choices" data-target="{div}">{options}</select></label></div>'
            + page.figure(figs["0"], div)
        )
    return out


def why_empty(runs: Sequence[Run], *keys: str) -> str:
    """Why a section has nothing to show, read from the runs' configs: the first of ``keys`` (``diagnostics.*``
    switches) that is off, ``" Here: diagnostics.heatmaps=false in every run (set by experiment=mqar)."``, where
    that value came from an experiment preset rather than the command line, or in ``k of n`` runs; "" when none of
    them is off (``diagnostics.importance=auto`` counts as off in a sweep: it runs in single runs only)."""
    with_config = [run for run in runs if run.config]
    for key in keys:
        off = [run for run in with_config if run.raw_value(key) is False or run.raw_value(key) in ("false", "False")]
        auto = key == "diagnostics.importance" and len(runs) > 1
        if auto and not off:
            off = [run for run in with_config if run.raw_value(key) == "auto"]
        if not off:
            continue
        value = "auto (single runs only; this is a sweep)" if auto and off[0].raw_value(key) == "auto" else "false"
        where = "every run" if len(off) == len(runs) else f"{len(off)} of {len(runs)} runs"
        given: set[str] = set()
        presets: set[str] = set()
        for run in off:
            overrides = run.summary.get("overrides") if run.summary else None
            for item in overrides if isinstance(overrides, list) else []:
                name, _, choice = str(item).lstrip("+~").partition("=")
                if name == key:
                    given.add(name)
                elif name == "experiment" and choice:
                    presets.add(choice)
        source = ""
        if given:
            source = " (set on the command line)"
        elif presets:
            source = f" (set by {' / '.join(f'experiment={p}' for p in sorted(presets, key=natural_key))})"
        return f" Here: {key}={value} in {where}{_e(source)}."
    return ""


def _curves_section(page: _Page, runs: Sequence[Run], sweep: Sweep, x: Dimension | None, note: str = "") -> str:
    """The training curves. First every configuration's validation curves on one shared axis (the ``validation``
    view: one panel per metric, one line per configuration, accuracy first), so that two models compare at a
    glance. Then the ``curve`` view: with a numeric main key of at most 6 values, one panel per value (the y axes
    of a metric's panels shared); otherwise (a sweep over models) one panel per metric with every configuration
    in it, its validation metrics left to the first chart. ``note``: said under both (a tuned sweep's runs)."""
    validation = [m for m in metrics_in("validation") if any(run.curve(m)[0].size for run in runs)]
    validation.sort(key=lambda m: spec_for(m).higher_is_better is not True)  # (accuracy before losses)
    curve_metrics = [m for m in metrics_in("curve") if any(run.curve(m)[0].size for run in runs)]
    facet = x if x is not None and x.numeric and len(x.values) <= 2 * figures.MAX_COLS else None
    if facet is None:
        curve_metrics = [m for m in curve_metrics if m not in validation]
    parts = []
    shared = figures.curves_figure(runs, sweep, validation, None) if validation else None
    if shared is not None:
        parts.append(
            '<p class="note">Validation curves of every configuration on one axis per metric: the mean over its seeds '
            "with the 95 % band. Failed runs count up to where they stopped."
            + note
            + "</p>"
            + page.figure(shared, "fig-validation")
        )
    fig = figures.curves_figure(runs, sweep, curve_metrics, facet) if curve_metrics else None
    if fig is not None:
        parts.append(
            '<p class="note">'
            + ("The other curves: m" if shared is not None and facet is None else "M")
            + "ean over seeds per configuration, with the 95 % band"
            + (f"; one panel per <b>{_e(facet.name)}</b>, the y axis shared along a row" if facet else "")
            + ". Failed runs count up to where they stopped.</p>"
            + page.figure(fig)
        )
    if not parts:
        why = " Here: no run has a metrics.jsonl." if not any(r.metric_log.row_count for r in runs) else ""
        return Empty(f"no metrics.jsonl rows with a curve to draw.{why}")
    return "".join(parts)


def _heads_section(page: _Page, runs: Sequence[Run], sweep: Sweep, metric: str) -> str:
    """Per layer x head heatmaps, one per value of the first key (the variant), the best run shown first and a
    selector for the others."""
    stats = [m.removeprefix("attn/") for m in metrics_in("head")]
    out = _run_figures(page, runs, sweep, metric, lambda run: figures.head_figure(run, stats), "heads")
    why = why_empty(runs, "diagnostics.enabled")
    return "".join(out) or Empty(f"no run logged per-head diagnostics (attn/L{{l}}H{{h}}/...) in metrics.jsonl.{why}")


def _atlas_section(
    page: _Page, runs: Sequence[Run], sweep: Sweep, metric: str, chart_runs: Sequence[Run] | None = None
) -> str:
    """What the heads do: the head atlas of each value of the first key (the variant; its best run first, a
    selector for the others), then the pruning curves and rank collapse against depth of the whole sweep, drawn
    from ``chart_runs`` (default ``runs``; a tuned sweep's seed runs, never its tuning grid's other points)."""
    tuned_out = chart_runs is not None and len(chart_runs) < len(runs)
    chart_runs = runs if chart_runs is None else chart_runs
    seeds_only = (
        " Of a tuned sweep, only the seed runs, at each configuration's chosen point (not the tuning grid's runs)."
        if tuned_out
        else ""
    )
    out = _run_figures(page, runs, sweep, metric, atlas_figure, "atlas")
    legend = " ".join(
        f'<span class="type" style="background:{colour}">{_e(HEAD_TYPES[kind])}</span>'
        for kind, colour in TYPE_COLOURS.items()
    )
    parts = [
        '<p class="note">Each head of the run, named by its highest head-type score on a probe of repeated random '
        "tokens [x; x] (previous token, duplicate token, induction; local only when none of those reaches "
        f"{HEAD_THRESHOLD:g}, none when nothing does), with that score, its importance |∂L/∂ξ_h| on the validation "
        "set at the end (Michel et al. 2019) and the first diagnostics step at which that score reached the "
        f"threshold; hover a head for every score. {legend}</p>"
    ]
    none = (
        "no run logged head-type scores (attn/L{l}H{h}/induction ...): a task without a vocabulary "
        "(digits), diagnostics.heads=false, or runs of attnlab before 0.6."
        + why_empty(runs, "diagnostics.enabled", "diagnostics.heads")
    )
    parts += out or [f'<p class="empty"><b>Head atlas</b>: {none}</p>']
    charts = [
        (
            "Pruning",
            pruning_figure(chart_runs, sweep),
            "fig-pruning",
            "The test metric of each configuration as its heads are removed at test time (gate 0), from the least "
            "important up (importance normalised per layer, Michel et al. 2019; solid) and in random order (dotted), "
            "the mean over its seeds; the first point is the unpruned model's test metric (pruning.json of each run)."
            + seeds_only,
            "no run wrote pruning.json (diagnostics.importance=false, or an older run)."
            + why_empty(chart_runs, "diagnostics.importance"),
        ),
        (
            "Rank collapse",
            rank_figure(chart_runs, sweep),
            "fig-rank",
            "The relative residual ‖X − 1x̄ᵀ‖_F / ‖X‖_F of the token representations of the validation probe from "
            "their mean (Dong et al. 2021), at the end of training, against the layer: 0 means every token has the "
            "same representation (rank 1). Mean over seeds with the 95 % t interval." + seeds_only,
            "no run logged rank collapse (attn/L{l}/rank_residual)."
            + why_empty(chart_runs, "diagnostics.enabled", "diagnostics.heads"),
        ),
    ]
    if not out and all(fig is None for _, fig, *_ in charts):  # nothing at all: one line
        why = why_empty(runs, "diagnostics.enabled", "diagnostics.heads") or why_empty(
            chart_runs, "diagnostics.importance"
        )
        return Empty(
            "no run logged head-type scores (attn/L{l}H{h}/induction ...) or rank collapse, nor wrote pruning.json "
            "(a task without a vocabulary such as digits, diagnostics.heads=false, diagnostics.importance=false, or "
            f"runs of attnlab before 0.6).{why}"
        )
    for title, fig, div, note, missing in charts:
        if fig is None:  # a chart with nothing to draw: one line
            parts.append(f'<p class="empty"><b>{title}</b>: {missing}</p>')
        else:
            parts.append(f'<h3>{title}</h3><p class="note">{note}</p>{page.figure(fig, div)}')
    return "".join(parts)


def _maps_section(page: _Page, runs: Sequence[Run], sweep: Sweep, metric: str) -> str:
    """The attention maps the runs saved, one per value of the first key (the variant): the best run's, with a
    selector for the others."""
    first = sweep.dims[0] if sweep.dims else None
    ranked = _ranked(runs, metric, first)
    out = []
    for group, members in sorted(ranked.items(), key=lambda kv: natural_key(kv[0])):
        images = []
        for run in members:
            for image in run.images():
                try:
                    if os.lstat(image).st_size > MAX_IMAGE_BYTES:
                        continue
                    data = read_bytes(image)  # never through a link (Run.images leaves links out, with a warning)
                except (OSError, RunFileError):
                    continue
                caption = f"{_selector_label(run, sweep, metric)}/{image.relative_to(run.path).as_posix()}"
                images.append({"src": "data:image/png;base64," + base64.b64encode(data).decode(), "caption": caption})
                break
            if len(images) >= MAX_MAP_RUNS:
                break
        if not images:
            continue
        index = len(page.scripts)
        img = f"map-{index}"
        page.data(f"{img}-images", images)
        options = "".join(f'<option value="{i}">{_e(image["caption"])}</option>' for i, image in enumerate(images))
        name = first.label(group) if first else "all runs"
        out.append(
            f'<figure><h3>{_e(name)}</h3><div class="pick"><select data-images="{img}-images" data-target="{img}">'
            f'{options}</select></div><img id="{img}" src="{images[0]["src"]}" alt="{_e(images[0]["caption"])}">'
            f"<figcaption>{_e(images[0]['caption'])}</figcaption></figure>"
        )
    if not out:
        why = why_empty(runs, "diagnostics.enabled", "diagnostics.heatmaps")
        return Empty(f"no run saved attention maps (attention/maps.png).{why}")
    return (
        '<p class="note">One probe sequence per run: rows are queries, columns keys (token positions from 0), the '
        "colour the attention weight. Each variant shows its best run; pick another in its list.</p>"
        f'<div class="maps">{"".join(out)}</div>'
    )


def build_html(
    runs: Sequence[Run],
    title: str = "attnlab results",
    source: str = "",
    options: Options | None = None,
    root: str | os.PathLike[str] | None = None,
    tuned: Tuned | None = None,
) -> str:
    """The whole self-contained page for ``runs``. ``tuned``: the tuned sweeps among them (default
    :func:`~attnlab.dashboard.tuned.find_tuned` of ``runs`` under ``root``, default their common folder).

    Who wins and every chart of the whole folder (final metrics, step 0, lengths, curves) count the same runs:
    a tuned sweep's seed runs, each configuration at its chosen point, never its other tuning runs (those are the
    tuning chart's); the runs table lists every run."""
    from plotly.offline import get_plotlyjs

    if not runs:
        raise ValueError("no runs to show")
    options = options or Options()
    sweep = Sweep(runs, config_keys=options.config_keys)
    tuned = find_tuned(runs, root, config_keys=options.config_keys) if tuned is None else tuned
    seed_runs = {id(run) for t in tuned.sweeps for run in t.seed_runs}
    tuning_only = {id(run) for t in tuned.sweeps for run in t.tune_runs} - seed_runs
    chart_runs = [run for run in runs if id(run) not in tuning_only]
    chart_sweep = sweep
    if tuning_only:  # every tuned configuration at its chosen point: the tuned keys name no configuration
        inside = {id(run) for t in tuned.sweeps for run in t.runs}
        grid = {key for t in tuned.sweeps for key in t.grid} if all(id(r) in inside for r in runs) else set()
        chart_sweep = Sweep(chart_runs, exclude=grid, config_keys=sweep.config_keys, strict=False)
    try:
        x = chart_sweep.main_dim(options.x)
    except ValueError:
        if chart_sweep is sweep or sweep.dim(options.x) is None:  # (raises where --x varies nowhere)
            raise
        x = chart_sweep.main_dim(None)  # --x names a tuned key: the seed runs have one value per configuration
    if x is None and chart_sweep.dims:  # nothing numeric: the model (the first key) along the x axis, as points
        x = next(iter(chart_sweep.swept_dims()), chart_sweep.dims[0])
    facet = chart_sweep.facet_dim(x, options.facet)
    ok = [r for r in chart_runs if r.ok]
    page = _Page()
    sections: list[tuple[str, str, str]] = []  # (anchor, heading, html; an Empty one is written as one line)
    groups = _groups(runs, sweep, tuned)
    tuned_note = (
        f" Of the tuned sweep{'s' if len(tuned.sweeps) > 1 else ''}, only the {len(seed_runs)} seed runs (each "
        f"configuration at its chosen point), the runs Who wins compares; the {len(tuning_only)} other tuning "
        "runs are in Tuning."
        if tuning_only
        else ""
    )

    top = headline_metrics(chart_runs, options.metric)
    column = sweep.column_dim(options.x)
    head_html = []
    for name, plan, group_runs, group_sweep in groups:
        group_column = column if group_sweep is sweep else group_sweep.column_dim(options.x, strict=False)
        level = "h4" if name else "h3"
        notes = list(plan.grid) if plan is not None else []
        part = [f"<h3>{_e(name)}</h3>"] if name else []
        part += [_tuned_html(plan)] if plan is not None else []
        chosen = headline_metrics(group_runs, options.metric) if group_runs else []
        declared = [options.metric] if options.metric is not None else declared_metrics(group_runs)
        main = [m for m in chosen if m in declared] or chosen[:1]
        for metric in main:
            table = headline(group_runs, group_sweep, metric, group_column, notes=notes)
            where = _headline_note(metric, group_runs, options.metric)
            part.append(
                f'<{level}>{_e(metric)} <span class="tag">headline</span></{level}>'
                f'<p class="note">The headline metric, {_e(where)}.</p>{_headline_html(table)}'
            )
        also = [m for m in chosen if m not in main]
        if also:
            tables = "".join(
                f"<{level}>{_e(m)}</{level}>"
                + _headline_html(headline(group_runs, group_sweep, m, group_column, notes=notes))
                for m in also
            )
            part.append(
                f'<details class="also"><summary>Also compared: {_e(", ".join(also))} (click to show)</summary>'
                f"{tables}</details>"
            )
        if not chosen:
            part.append('<p class="note">No finished run reports a metric yet.</p>')
        head_html.append("".join(part))
    sections.append(("headline", "Who wins", "".join(head_html)))
    tuning_html = []
    for plan in tuned.sweeps:
        fig = figures.sensitivity_figure(plan)
        if fig is None:
            continue
        keys = ", ".join(k.rsplit(".", 1)[-1] for k in plan.grid)
        edge = "bottom" if plan.maximize else "top"
        note = (
            f'<p class="note">The tuning runs of {_e(plan.name)} (seed {plan.tune_seed}): {_e(plan.metric)} against '
            f"each tuned key ({_e(keys)}), one line per configuration"
            + (", the other keys at its chosen point" if len(plan.grid) > 1 else "")
            + f"; × a failed run (drawn at the {edge}, hover for the reason), ★ the point chosen for the seed runs."
            " One seed: no interval; these runs are not pooled into the headline.</p>"
        )
        tuning_html.append((f"<h3>{_e(plan.name)}</h3>" if len(tuned.sweeps) > 1 else "") + note + page.figure(fig))
    if tuning_html:
        sections.append(("tuning", "Tuning", "".join(tuning_html)))

    pareto_html = []
    for name, plan, group_runs, group_sweep in groups:
        metrics_p, costs = _pareto_inputs(group_runs)
        notes = list(plan.grid) if plan is not None else []
        fig = figures.pareto_figure(group_runs, group_sweep, metrics_p, costs, notes) if metrics_p else None
        if fig is None:
            continue
        which = "seed run" if plan is not None else "run"
        named = group_sweep.label_dims(group_sweep.dims)
        keys_note = (
            f"; colour: the {_e(named[0].name)}, marker: the other keys (in the legend; hover a point for its name)"
            if len(named) > 1
            else ""
        )
        note = (
            f'<p class="note">One point per configuration: the mean cost of its {which}s (log x) and its mean '
            f"{_e(' / '.join(metrics_p))} over them with the 95 % t interval (clipped to the metric's range)"
            + (", each at its own tuned point" if plan is not None else "")
            + keys_note
            + ". The dashed step line is the Pareto frontier: the configurations that no cheaper one matches "
            "(higher accuracy, lower bits per byte or loss wins). Costs from summary.json: FLOPs of a training step "
            "per token (forward and backward), trainable parameters, the state a sequence carries summed over the "
            "layers (softmax's key/value cache, linear attention's state), and the run's wall time.</p>"
        )
        pareto_html.append((f"<h3>{_e(name)}</h3>" if name else "") + note + page.figure(fig))
    if pareto_html:
        sections.append(("pareto", "Cost", "".join(pareto_html)))

    metrics = page_metrics(chart_runs, top)
    flat = {}  # metrics with one value in every finished run that reports them (softmax's row mass): named only
    for m in metrics[len(top) :]:
        values = {round(r.final(m), 9) for r in ok if r.final(m) is not None}
        if len(values) == 1:
            flat[m] = values.pop()
    metrics = [m for m in metrics if m not in flat]
    categorical = x is None or not x.numeric
    if metrics and ok:
        note = (
            f'<p class="note">Final values against <b>{_e(x.name if x else "the runs")}</b>'
            + (f", one panel per <b>{_e(facet.name)}</b>" if facet else "")
            + (
                "; one point per configuration (a categorical axis: points, never joined by lines)"
                if categorical
                else "; one line per combination of the other keys"
            )
            + "; error bars: 95 % t interval over seeds (clipped to the metric's range); "
            + ("points" if categorical else "lines")
            + " are shifted sideways a little so their intervals stay apart."
            " Click a legend entry to hide it in every panel, double-click to show only it."
            + tuned_note
            + _chance_note(ok)
            + _not_distributions(ok, chart_sweep, metrics)
            + (
                f" The same in every run, not drawn: {_e(', '.join(f'{m} = {v:.4g}' for m, v in flat.items()))}."
                if flat
                else ""
            )
            + "</p>"
        )
        fig = figures.comparison_figure(chart_runs, chart_sweep, metrics, x, facet)
        sections.append(("final", "Final metrics", note + page.figure(fig)))

    search_dims = [d for d in sweep.label_dims(sweep.dims) if d.numeric and len(d.values) >= SEARCH_MIN_VALUES]
    searched = optimized_metric(runs)  # (what a search optimised; the headline where no run reports it)
    searched = searched if any(r.final(searched) is not None for r in runs if r.ok) else top[0] if top else None
    if search_dims and searched:
        fig = figures.search_figure(runs, sweep, searched)
        if fig is not None:
            best = best_run(runs, searched)
            settings = ", ".join(d.label(best.value(d.key)) for d in sweep.label_dims(sweep.dims))
            note = (
                f'<p class="verdict">Best run: {_e(best.name)} ({_e(settings)}): {_e(searched)} = '
                f"{_e(spec_for(searched).format(best.final(searched)))}.</p>"
                f'<p class="note">Each point is one run ({_e(", ".join(d.name for d in search_dims))} took '
                f"{SEARCH_MIN_VALUES} or more values, as in an Optuna search); the star is the best run.</p>"
            )
            sections.append(("search", "Search", note + page.figure(fig)))

    length_fig = figures.length_figure(chart_runs, chart_sweep)
    if length_fig is not None:
        note = (
            '<p class="note">Accuracy on the extra test sets of each length L (<code>task.datamodule.test_lengths'
            "</code>; right: loss, or bits per byte for language modelling), mean over seeds with the 95 % t "
            "interval; the dashed vertical line marks the training length."
            + (
                f" The headline is {_e(', '.join(m for m in top if '@' in m))}: the task declares its longest test "
                "length as what it tests."
                if any("@" in m for m in top[:1])
                else ""
            )
            + tuned_note
            + "</p>"
        )
        sections.append(("lengths", "Length generalisation", note + page.figure(length_fig, "fig-lengths")))

    init = [m for m in metrics_in("init") if any(r.init(m) is not None for r in ok)]
    if init:
        fig = figures.comparison_figure(chart_runs, chart_sweep, init, x, facet, init=True)
        note = (
            '<p class="note">The attention diagnostics before the first step (step 0), by the same keys.'
            + _not_distributions(ok, chart_sweep, init)
            + "</p>"
        )
        sections.append(("init", "At initialisation", note + page.figure(fig)))

    sections.append(("curves", "Training curves", _curves_section(page, chart_runs, chart_sweep, x, tuned_note)))

    rank_metric = top[0] if top else "val/acc_best"
    sections.append(("heads", "Per layer × head", _heads_section(page, runs, sweep, rank_metric)))
    sections.append(("atlas", "What the heads do", _atlas_section(page, runs, sweep, rank_metric, chart_runs)))
    sections.append(("maps", "Attention maps", _maps_section(page, runs, sweep, rank_metric)))
    table_metrics = list(dict.fromkeys([*top, *metrics_in("table")]))
    table_metrics = [m for m in table_metrics if any(r.final(m) is not None for r in runs)]
    sections.append(
        (
            "runs",
            "Runs",
            '<p class="note">Click a header to sort; failed runs are red (hover the status for the reason).</p>'
            f'<div class="scroll">{_runs_table(runs, sweep, table_metrics)}</div>',
        )
    )

    muted = ' class="empty"'  # (a section with nothing to show: its link is muted)
    nav = "".join(f'<a href="#{a}"{muted if isinstance(b, Empty) else ""}>{_e(h)}</a>' for a, h, b in sections)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{_asset('page.css')}</style>",
        f"<script>{_asset('errors.js')}</script>",
        f'<script type="text/javascript">{get_plotlyjs()}</script>',
        "</head><body>",
        '<div id="js-errors"></div>',
        _header(runs, sweep, title, source),
        *(f'<p class="meta warn">Warning: {_e(problem)}</p>' for problem in tuned.problems),
        f"<nav>{nav}</nav>",
    ]
    parts += [_section_html(a, h, body) for a, h, body in sections]
    parts += page.scripts
    parts += [f"<script>{_asset('page.js')}</script>", "</body></html>"]
    return "\n".join(parts) + "\n"


def _section_html(anchor: str, heading: str, body: str) -> str:
    """A section: its heading and body; a section with nothing to show (:class:`Empty`) is one line, its heading
    and why (``Per layer × head: no run logged per-head diagnostics ...``)."""
    if isinstance(body, Empty):
        return f'<section id="{anchor}"><p class="empty"><b>{_e(heading)}</b>: {body}</p></section>'
    return f'<section id="{anchor}"><h2>{_e(heading)}</h2>{body}</section>'
