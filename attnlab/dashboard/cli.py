"""``attnlab-dashboard PATH``: the page, the terminal table and the CSV export."""

from __future__ import annotations

import argparse
import csv
import errno
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnlab.config import SETTING_FIELDS
from attnlab.console import plain_console, printable
from attnlab.dashboard.dims import Sweep
from attnlab.dashboard.figures import PROBABILITY_METRICS, SIGNED_CELL, signed_layers
from attnlab.dashboard.load import MISSING, Run, load_runs
from attnlab.dashboard.metrics import metrics_in, short_name
from attnlab.dashboard.page import Options, build_html, format_time, headline_metrics
from attnlab.dashboard.tuned import Tuned, find_tuned
from attnlab.runs import CONFIG_FILE, SUMMARY_FILE, atomic_open, attention_sources, csv_safe
from attnlab.stats import spec_for

__all__ = ["DEFAULT_OUTPUT", "main", "print_table", "write_csv", "write_dashboard"]

DEFAULT_OUTPUT = "dashboard.html"
DESCRIPTION = (  # (the first line of attnlab.dashboard's docstring: that package imports this module, not back)
    "A self-contained results page (and a terminal table and a CSV) for a run folder, a sweep or a folder of sweeps."
)
CSV_SETTINGS = (*SETTING_FIELDS, "pattern", "backends")  # each layer's attention, from AttentionConfig's fields


def write_dashboard(
    path: str | Path,
    output: str | Path | None = None,
    runs: Sequence[Run] | None = None,
    options: Options | None = None,
    tuned: Tuned | None = None,
) -> Path:
    """Write the page for the runs under ``path`` (or the given ``runs``) to ``output`` (default
    ``<path>/dashboard.html``) and return its path. ``tuned``: the tuned sweeps among the runs (default: those whose
    ``tuned.json`` is under ``path``, :func:`~attnlab.dashboard.tuned.find_tuned`).

    Raises FileNotFoundError when ``path`` is not a folder and ValueError when it holds no run or an option names
    a key that does not vary."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder")
    runs = load_runs(root) if runs is None else runs
    if not runs:
        raise ValueError(f"no runs under {root} (no {SUMMARY_FILE} or {CONFIG_FILE} found)")
    page = build_html(
        runs, title=f"attnlab · {root.resolve().name}", source=str(root), options=options, root=root, tuned=tuned
    )
    out = Path(output) if output is not None else root / DEFAULT_OUTPUT
    with atomic_open(out, "wb") as f:  # (a link at that name is replaced, never written through)
        f.write(page.encode("utf-8"))
    return out


def _fmt(value: float | int | None, kind: str) -> str:
    if value is None:
        return "-"
    return f"{int(value):,}" if kind == "int" else f"{value:.3f}"


def _cell(run: Run, metric: str) -> str:
    """A table cell of a metric of the ``table`` or ``terminal`` view: ``signed`` for an entropy-like statistic of
    a run whose every layer has signed weights (:func:`~attnlab.dashboard.figures.signed_layers`: none logged)."""
    value = run.final(metric)
    if value is None and metric.removeprefix("attn/") in PROBABILITY_METRICS:
        found = signed_layers(run)
        if found is not None and found[1] and len(found[0]) == found[1]:
            return SIGNED_CELL
    return spec_for(metric).format(value) if spec_for(metric).si else _fmt(value, "f")


def print_table(runs: Sequence[Run], console: Any = None, config_keys: Sequence[str] | None = None) -> None:
    """A compact rich table of ``runs``: the keys that vary (those of ``config_keys`` only, where given), seed, the
    headline metrics (the task's declared one first, named under the table), the metrics of the ``table`` view
    (entropy and saturation; ``signed`` for a run whose every layer has signed weights, which has none), status
    and time; 120 columns wide when the output is not a terminal (CI logs). Then the metrics of the ``terminal``
    view that some run reports (``FLOPs/tok``).

    The keys that labels name, the seed and the metrics are never cut or wrapped: where they do not fit the width,
    the status wraps first, and a table that still does not fit is printed wider than the console, never cropped.
    The run knobs that labels leave out (:data:`~attnlab.dashboard.dims.RUN_KNOBS`: ``max_steps``, ``eval_every``,
    test sizes, ...) are one short column, ``knobs``, naming each distinct set (``k1``, ``k2``), spelled out under
    the table."""
    from rich import box
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

    if console is None:
        console = plain_console()  # run names, config keys and values are text, never markup
    sweep = Sweep(runs, config_keys=config_keys)
    dims = sweep.label_dims(sweep.dims)
    knobs = [d for d in sweep.dims if d not in dims]
    metrics = headline_metrics(runs)[:3]
    extra = [m for m in metrics_in("table") if m not in metrics]
    extra += [m for m in metrics_in("terminal") if m not in [*metrics, *extra] and any(r.final(m) for r in runs)]
    rows = []
    knob_sets: dict[str, str] = {}  # "max_steps=5 · eval_every=5" -> "k1"
    for run in runs:
        row = [printable(d.format(run.value(d.key))) for d in dims]
        row += [_fmt(run.seed, "int"), *[spec_for(m).format(run.final(m)) for m in metrics]]
        row += [_cell(run, m) for m in extra]
        row += [printable(run.status), format_time(run.wall_time_s)]
        if knobs:
            text = " · ".join(printable(f"{d.name}={d.format(run.value(d.key))}") for d in knobs)
            row.append(knob_sets.setdefault(text, f"k{len(knob_sets) + 1}"))
        rows.append(row)
    headers = [*(d.name for d in dims), "seed", *metrics, *map(short_name, extra), "status", "time"]
    headers += ["knobs"] if knobs else []
    table = Table(title=f"attnlab · {len(runs)} runs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    status = len(dims) + 1 + len(metrics) + len(extra)
    for i, header in enumerate(headers):
        kept = i != status  # every column but the status keeps its text on one line
        words = [row[i] for row in rows] if kept else [w for row in rows for w in row[i].split()]
        widest = max([len(header), *map(len, words)])
        left = i == status or (knobs and i == len(headers) - 1) or (i < len(dims) and not dims[i].numeric)
        table.add_column(
            printable(header),
            justify="left" if left else "right",
            no_wrap=kept,
            min_width=widest,
            overflow="fold",
        )
    for run, row in zip(runs, rows, strict=True):
        style = "" if run.ok else ("yellow" if run.status == "running" else "red")
        table.add_row(*(Text(cell) for cell in row), style=style)
    needed = Measurement.get(console, console.options.update_width(100_000), table).minimum
    if needed > console.width:  # the key columns alone are wider than the console: print wide, never crop
        width = console.width
        console.width = needed  # (print(width=...) is capped at the console's width)
        try:
            console.print(table, crop=False)
        finally:
            console.width = width
    else:
        console.print(table)
    for text, name in knob_sets.items():
        console.print(Text(f"{name}: {text}", overflow="fold"))
    if metrics:
        console.print(Text(f"headline: {metrics[0]} (the first metric column)", overflow="fold"))


def write_csv(runs: Sequence[Run], path: str | Path) -> Path:
    """One row per run: identity, key config values, every key that varies across the runs (by its dotted config
    key: ``lr``, ``variant.params.d_attn``), the final metrics of the ``csv`` view and the step-0 (``init/...``)
    values of its diagnostics, settings, and ``test/acc@L`` (the ``length`` view: ``test/loss@L``, ``test/bpc@L``)
    for every test length any run reports. After ``params`` and ``state_size`` (summed over the layers), the
    compute fields of the ``compute`` view (``params_non_embedding``, ``flops_per_token``, ``tokens_seen``,
    ``step_time_s``; empty for a run before summary.json's schema 5)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep = Sweep(runs)
    fixed = ["variant", "variant_params", "mask", "task", "pos_encoding", "d_k", "num_heads", "d_model"]
    known = {"variant.name", "mask.name", "task.name", "model.pos_encoding", "d_k", "num_heads", "d_model"}
    swept = [d.key for d in sweep.dims if d.key not in known]
    final = metrics_in("csv")
    compute = [m for m in metrics_in("compute") if m not in final and m not in ("params", "state_size", "wall_time_s")]
    init = [m for m in final if m.startswith("attn/")]  # the diagnostics, also logged at step 0
    columns = ["run", *fixed, *swept, "seed", "params", "state_size", *compute, "status", "reason", "wall_time_s"]
    columns += final
    columns += [f"init/{m}" for m in init]
    columns += list(CSV_SETTINGS)
    lengths = [f"{m}@{n}" for m in metrics_in("length") for n in sorted({n for r in runs for n in r.by_length(m)})]
    columns += lengths
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([_csv_cell(c) for c in columns])
        for run in runs:
            params = run.setting("variant_params", "variant.params") or {}
            row: list[Any] = [run.name, run.variant, json.dumps(params, sort_keys=True, default=str) if params else ""]
            row += [run.mask, run.task, run.setting("pos_encoding", "model.pos_encoding"), run.d_k, run.num_heads]
            row += [run.d_model]
            row += [None if run.value(k) == MISSING else run.value(k) for k in swept]
            row += [run.seed, run.params, run.state_size, *(run.final(m) for m in compute)]
            row += [run.status, run.reason or ""]
            row += [None if run.wall_time_s is None else round(run.wall_time_s, 1)]
            row += [run.final(m) for m in final]
            row += [run.init(m) for m in init]
            row += [_setting(run, k) for k in CSV_SETTINGS]
            row += [run.final(m) for m in lengths]
            writer.writerow([_csv_cell(v) for v in row])
    return path


def _csv_cell(value: Any) -> Any:
    """A CSV cell: "" for None, text through :func:`attnlab.runs.csv_safe` (a run name or config value never starts
    a spreadsheet formula), numbers as they are."""
    if value is None:
        return ""
    return csv_safe(value) if isinstance(value, str) else value


def _write_error(err: OSError, path: Path, option: str = "-o") -> str:
    """One line for a file the dashboard cannot write: a read-only folder is named as such, with the option that
    writes elsewhere (``-o`` for the page, ``--csv`` for the CSV)."""
    folder = path.parent if str(path.parent) else Path(".")
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"cannot write {path}: the folder {folder} is read-only ({err.strerror or err}); "
            f"write it elsewhere with {option} /tmp/{path.name}"
        )
    return f"cannot write {path} ({err.strerror or err})"


def _setting(run: Run, key: str) -> Any:
    """A setting from the summary, else (a run older than its summary field) from the config key it comes from."""
    value = run.setting(key, attention_sources().get(key, f"model.{key}"))
    if isinstance(value, list):  # one per layer: the one value, or each layer's
        return None if not value else value[0] if len(set(map(str, value))) == 1 else "/".join(map(str, value))
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``attnlab-dashboard PATH [-o FILE] [--x KEY] [--facet KEY] [--metric NAME] [--config-keys K1,K2] [--csv
    FILE]``: write the page and print the runs table; 2 on a bad PATH or option."""
    parser = argparse.ArgumentParser(prog="attnlab-dashboard", description=DESCRIPTION)
    parser.add_argument("path", type=Path, help="a run folder, a multirun folder, or a folder of sweeps")
    parser.add_argument("-o", "--output", type=Path, default=None, help=f"output file (default PATH/{DEFAULT_OUTPUT})")
    parser.add_argument("--csv", type=Path, default=None, help="also write one CSV row per run to this file")
    parser.add_argument("--x", default=None, help="the main key: headline columns and x axis (default: the first "
                        "numeric key that varies, e.g. d_k)")  # fmt: skip
    parser.add_argument("--facet", default=None, help="the key split into panels, or 'none' (default: the other "
                        "key with the fewest values, 2 to 4)")  # fmt: skip
    parser.add_argument("--metric", default=None, help="the headline metric (default: the one the runs' task "
                        "declares: test/acc, test/bpc for language modelling, test/acc@<longest L> for a "
                        "state-tracking task with test_lengths)")  # fmt: skip
    parser.add_argument("--config-keys", default=None, metavar="K1,K2", help="the keys that define a "
                        "configuration (config keys, dotted or their last part; variant or model for the model), "
                        "e.g. variant,d_k: every other key that varies is an attribute, shown in the header and "
                        "beside the headline's rows, and runs that differ only in it pool (default: found: every "
                        "key that varies, but what a model's preset sets, e.g. short_conv, is an attribute of "
                        "the model)")  # fmt: skip
    args = parser.parse_args(argv)
    config_keys = None
    if args.config_keys is not None:
        config_keys = tuple(k.strip() for k in args.config_keys.split(",") if k.strip())
        if not config_keys:
            print(
                "attnlab-dashboard: error: --config-keys names no key; give the keys that define a configuration, "
                "e.g. --config-keys variant,d_k",
                file=sys.stderr,
            )
            return 2
    options = Options(x=args.x, facet=args.facet, metric=args.metric, config_keys=config_keys)
    try:
        runs = load_runs(args.path) if args.path.is_dir() else []
        tuned = find_tuned(runs, args.path, config_keys=config_keys)
        out = write_dashboard(args.path, args.output, runs=runs, options=options, tuned=tuned)
    except (FileNotFoundError, ValueError) as err:
        print(f"attnlab-dashboard: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a read-only folder (or a full disk): one line, no traceback
        out = args.output or args.path / DEFAULT_OUTPUT
        named = Path(err.filename) if isinstance(err.filename, str) else out
        if named.parent != out.parent:  # not the page's folder (a file that could not be read): as it is
            print(f"attnlab-dashboard: error: {printable(str(err))}", file=sys.stderr)
            return 2
        print(f"attnlab-dashboard: error: {printable(_write_error(err, out))}; nothing written", file=sys.stderr)
        return 2
    for run in runs:
        for problem in run.problems:
            print(f"attnlab-dashboard: warning: run {printable(run.name)}: {printable(problem)}", file=sys.stderr)
    for problem in tuned.problems:
        print(f"attnlab-dashboard: warning: {printable(problem)}", file=sys.stderr)
    try:
        csv_path = write_csv(runs, args.csv) if args.csv is not None else None
    except OSError as err:
        print(f"attnlab-dashboard: error: {printable(_write_error(err, args.csv, '--csv'))}", file=sys.stderr)
        return 2
    try:
        print_table(runs, config_keys=config_keys)  # (Rich: on a broken pipe, the same as below, then SystemExit(1))
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, of which plotly.js {_plotly_mb():.1f} MB)")
        if csv_path is not None:
            print(f"wrote {csv_path}")
        sys.stdout.flush()
    except BrokenPipeError:  # stdout's reader has gone (| head): Python's way (signal docs, "Note on SIGPIPE")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (no second error at the flush on exit)
        return 1
    return 0


def _plotly_mb() -> float:
    from plotly.offline import get_plotlyjs

    return len(get_plotlyjs().encode()) / 1e6
