"""The capability report card: MAD's synthetic tasks for a list of variants, each at its own tuned settings.

    python -m attnlab.card                                   # the default card: 4 families × 6 tasks × 3 seeds
    python -m attnlab.card --variants scaled_dot,based --tasks selective_copy,compression --out card/mine

MAD (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid Architectures") probes an architecture with six
synthetic tasks, each isolating one capability: in-context recall (our MQAR, ``associative_recall``), fuzzy
in-context recall, noisy in-context recall, selective copying, compression and memorisation (see
:mod:`attnlab.tasks.mad`). For each task the card runs one tuned sweep (:mod:`attnlab.training.tuned`: every
variant on the learning-rate grid with the tuning seed, then its best rate on every seed) into ``<out>/<task>/``,
with ``experiment=card`` (``conf/experiment/card.yaml``: 2 layers, d_model 32, causal, a short convolution of 4)
and each task's card sizes (:data:`TASK_OVERRIDES`). It then writes ``<out>/card.csv`` (one row per task and variant)
and ``<out>/card.html`` (variant × task: the mean test accuracy over seeds ± its 95 % t interval, and the winner of
each task: the best mean, called a win only when its paired margin over every other variant holds after Holm's
correction, else a tie among the variants it does not beat).

The card runs the tasks one after the other, two jobs at a time (``--jobs``; joblib). Started again with the same
``--out``, it resumes: finished jobs are not run again, and ``--report`` rewrites the page from what is there. It
exits 1 when a task's sweep failed (a variant with no grid point or no seed run that finished ok), 2 for a refused
setting. Ctrl-C or SIGTERM stops the running task's sweep (the signal is passed on; after a grace period the sweep
is killed), writes the card so far and exits 130 or 143.

The card reads each task's ``tuned.json`` as untrusted input, as the dashboard does: a field that fails a check costs
one warning and is left out (a seed run outside the sweep folder is never opened), the card is built from the rest.
Text cells of ``card.csv`` never begin a spreadsheet formula (:func:`attnlab.runs.csv_safe`).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import html
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CARD_TASKS",
    "DEFAULT_VARIANTS",
    "FAMILIES",
    "TASK_OVERRIDES",
    "CardCell",
    "card_command",
    "collect",
    "default_variants",
    "main",
    "write_card",
]

CARD_TASKS = ("associative_recall", "fuzzy_recall", "noisy_recall", "selective_copy", "compression", "memorization")
FAMILIES = ("softmax", "linear", "decay", "delta")
"""The families the card compares, as form tags (:attr:`attnlab.forms.Form.tags`), from the most general to the most
specific: a form's family is the last of these among its tags (Gated DeltaNet, ``decay`` and ``delta``, is a delta
rule), or its own name when it has none of them."""


def default_variants() -> tuple[str, ...]:
    """The card's default variants, read from the form registry now: one per family (:data:`FAMILIES`), the newest
    registered form of each, families in the order their first form was registered; the softmax form is shown as
    the default config's score (``scaled_dot``). The built-ins give softmax, linear attention, a decay form and a
    delta rule: ``scaled_dot, linear, gla, rwkv7`` (RWKV-7, tagged ``decay`` and ``delta``, is the newest delta rule,
    registered after ``kda`` and ``deltaproduct``: the built-in modules of attnlab/forms register in name order
    after softmax, linear and transitions); the softmax family is always the default config's score, not a later
    form that computes a softmax (multi-head latent attention, ``mla``: ``--variants mla`` names it); a form
    registered later (a user's module) stands for its family, or for
    a family of its own. A form's named settings (:attr:`attnlab.forms.Form.settings`: ``gla``'s
    ``gate``, the delta rules' ``beta_range``) are variants of their own (``--variants kda_beta2,gated_deltanet_beta2``,
    :mod:`attnlab.training.compare`), each a row of the card under its name."""
    from attnlab.config import AttentionConfig
    from attnlab.forms import form_class, form_for, list_forms

    newest: dict[str, str] = {}
    for name in list_forms():
        tags = form_class(name).tags
        family = next((f for f in reversed(FAMILIES) if f in tags), name)
        if family == "softmax" and family in newest:
            continue  # softmax attention is the default config's, whatever else computes a softmax (MLA)
        newest[family] = name  # (a family keeps the place of its first form)
    default = AttentionConfig()
    return tuple(default.score if form_for(default) == name else name for name in newest.values())


DEFAULT_VARIANTS = default_variants()
"""The default variants of the built-in forms (:func:`default_variants`, read when this module was imported)."""
DEFAULT_GRID = (3e-3, 1e-2)
DEFAULT_SEEDS = (1, 2, 3)
# each task's card sizes (the tasks' own defaults where they are absent); MQAR at MAD's small end
TASK_OVERRIDES: dict[str, tuple[str, ...]] = {
    "associative_recall": (
        "task.datamodule.num_pairs=8",
        "task.datamodule.seq_len=32",
        "task.datamodule.vocab_keys=16",
        "task.datamodule.vocab_values=16",
        "task.datamodule.num_train=10000",
    ),
}
METRIC = "test/acc"


def card_command(
    task: str,
    variants: Sequence[str],
    out: Path,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    grid: Sequence[float] = DEFAULT_GRID,
    jobs: int = 2,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``train.py`` command line of one task's tuned sweep."""
    launcher = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"] if jobs > 1 else []
    return [
        sys.executable,
        "-c",
        "import sys; from attnlab.training.cli import main; sys.argv[0] = 'train.py'; main()",
        "-m",
        "hydra/sweeper=tuned",
        *launcher,
        "experiment=card",
        f"task={task}",
        f"variant={','.join(variants)}",
        *TASK_OVERRIDES.get(task, ()),
        f"hydra.sweeper.grid={{lr:[{','.join(format(g, 'g') for g in grid)}]}}",
        f"hydra.sweeper.seeds=[{','.join(str(s) for s in seeds)}]",
        *extra,
        f"hydra.sweep.dir={out / task}",
    ]


@dataclass
class CardCell:
    """One task × variant: the seeds' test accuracy, its mean and 95 % half-width, the tuned learning rate, chance,
    and the verdict (``win``, ``tie`` for a best-mean variant whose margin does not hold, or empty)."""

    task: str
    variant: str
    lr: Any
    values: dict[int, float]
    mean: float
    half_width: float | None
    chance: float | None
    verdict: str = ""
    adjusted_p: float | None = None  # the winner's Holm-adjusted p against this variant (None for the winner)


def _variant_of(label: str) -> str:
    for part in label.split(","):
        if part.startswith("variant="):
            return part.split("=", 1)[1]
    return label


def collect(out: Path, tasks: Sequence[str] = CARD_TASKS, problems: list[str] | None = None) -> list[CardCell]:
    """The card's cells from the tuned sweeps under ``out`` (a task without ``tuned.json`` is left out).

    ``tuned.json`` is untrusted: a file that cannot be read (a link, not JSON, nested too deeply) and each field that
    fails a check (a configuration that is not an object, a label that is not text, a seed that is not an integer,
    a job outside the sweep folder ...) add one line to ``problems`` and are left out; the rest is used."""
    from attnlab.runs import RunFileError, RunFolder
    from attnlab.stats import mean_ci
    from attnlab.training.tuned import read_plan

    problems = [] if problems is None else problems
    cells: list[CardCell] = []
    for task in tasks:
        plan = read_plan(out / task, problems)
        if plan is None:
            continue
        where = out / task / "tuned.json"
        task_cells = []
        for label, best, seeds in _plan_entries(plan, where, problems):
            values: dict[int, float] = {}
            chance = None
            for seed, job in seeds:
                try:  # (a job outside the sweep folder was left out above: never read)
                    summary = RunFolder(out / task / job).read_summary(problems=[])
                except (RunFileError, OSError, ValueError):
                    continue
                if summary is None or summary.status != "ok":
                    continue
                value = summary.metrics.get(summary.headline_metric or METRIC)  # (the task's headline metric)
                if isinstance(value, int | float) and math.isfinite(value):
                    values[seed] = float(value)
                chance = summary.chance_accuracy
            mean, half, _ = mean_ci(values.values())
            lr = best.get("lr") if best else None
            task_cells.append(CardCell(task, _variant_of(label), lr, values, mean, half, chance))
        _verdicts(task_cells)
        cells.extend(task_cells)
    return cells


def _show(value: Any, limit: int = 60) -> str:
    from attnlab.console import printable

    text = printable(repr(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plan_entries(
    plan: dict[str, Any], where: Path, problems: list[str]
) -> list[tuple[str, dict[str, Any] | None, list[tuple[int, str]]]]:
    """(label, best point, [(seed, job)]) of each configuration of ``plan`` whose fields pass the dashboard's
    checks; one line in ``problems`` per field that does not (that configuration, or that seed run, is left out)."""
    from attnlab.dashboard.tuned import job_folder

    entries = plan.get("configurations")
    if not isinstance(entries, list):
        problems.append(f"{where}: configurations is {_show(entries)}, not a list: no cell read")
        return []
    out = []
    for i, entry in enumerate(entries):
        at = f"{where}: configurations[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{at} is {_show(entry)}, not an object: left out")
            continue
        label = entry.get("label")
        if not isinstance(label, str) or not label or len(label) > 1000:
            problems.append(f"{at}.label is {_show(label)}, not a configuration's name: left out")
            continue
        best = entry.get("best")
        if best is not None and not (isinstance(best, dict) and _scalar(best.get("lr"))):
            problems.append(f"{at}.best is {_show(best)}, not a grid point: its lr is not shown")
            best = None
        seeds_raw = entry.get("seeds") or []
        if not isinstance(seeds_raw, list):
            problems.append(f"{at}.seeds is {_show(seeds_raw)}, not a list: no seed run read")
            seeds_raw = []
        seeds: list[tuple[int, str]] = []
        for j, item in enumerate(seeds_raw):
            if not isinstance(item, dict):
                problems.append(f"{at}.seeds[{j}] is {_show(item)}, not an object: left out")
                continue
            seed = item.get("seed")
            if not isinstance(seed, int) or isinstance(seed, bool):
                problems.append(f"{at}.seeds[{j}].seed is {_show(seed)}, not an integer: left out")
                continue
            try:
                job = job_folder(item.get("job"), f"{at}.seeds[{j}].job")
            except ValueError as exc:
                problems.append(f"{exc}: left out")
                continue
            if any(seed == s for s, _ in seeds):
                problems.append(f"{at}.seeds[{j}].seed {seed} is listed twice: left out")
                continue
            seeds.append((seed, job))
        out.append((label, best, seeds))
    return out


def _scalar(value: Any) -> bool:
    """A grid value: a finite number, a word, or null."""
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, int | str)


def _verdicts(cells: list[CardCell]) -> None:
    """The best mean wins when its paired margin over every other variant holds after Holm's correction (paired t
    over the seeds both ran; alpha 0.05); otherwise it and the variants it does not beat tie."""
    from attnlab.dashboard.stats import ALPHA
    from attnlab.stats import holm, paired_difference

    scored = [c for c in cells if c.values]
    if not scored:
        return
    best = max(scored, key=lambda c: c.mean)
    rivals = [c for c in scored if c is not best]
    # an untestable comparison (fewer than 2 seeds) counts as p = 1: the winner does not beat that rival
    p_values = [1.0 if (p := paired_difference(best.values, c.values).p) is None else p for c in rivals]
    adjusted = holm(p_values)
    beaten = []
    for rival, p in zip(rivals, adjusted, strict=True):
        rival.adjusted_p = p
        beaten.append(p < ALPHA)
    if all(beaten):
        best.verdict = "win"
    else:
        best.verdict = "tie"
        for rival, won in zip(rivals, beaten, strict=True):
            if not won:
                rival.verdict = "tie"


def write_card(out: Path, cells: Sequence[CardCell], seconds: float | None = None) -> tuple[Path, Path]:
    """``<out>/card.csv`` and ``<out>/card.html`` from ``cells``."""
    from attnlab.runs import atomic_open, csv_safe

    out.mkdir(parents=True, exist_ok=True)
    csv_path, html_path = out / "card.csv", out / "card.html"
    with atomic_open(csv_path, "w") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "variant", "lr", "n", "test_acc", "half_width", "chance", "verdict", "holm_p"])
        for c in cells:
            writer.writerow(
                [
                    csv_safe(c.task),
                    csv_safe(c.variant),
                    csv_safe(c.lr) if isinstance(c.lr, str) else c.lr,  # (a number stays a number)
                    len(c.values),
                    _num(c.mean),
                    _num(c.half_width),
                    _num(c.chance),
                    csv_safe(c.verdict),
                    _num(c.adjusted_p),
                ]
            )
    with atomic_open(html_path, "w") as f:
        f.write(card_html(cells, seconds))
    return csv_path, html_path


def _num(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else f"{value:.6g}"


def card_html(cells: Sequence[CardCell], seconds: float | None = None) -> str:
    """The card as one self-contained page (no script, no request): a variant × task table."""
    from attnlab.dashboard.page import CSP
    from attnlab.stats import half_width_text, spec_for

    tasks = list(dict.fromkeys(c.task for c in cells))
    variants = list(dict.fromkeys(c.variant for c in cells))
    by = {(c.task, c.variant): c for c in cells}
    e = html.escape
    rows = []
    for variant in variants:
        tds = [f"<th>{e(variant)}</th>"]
        for task in tasks:
            c = by.get((task, variant))
            if c is None or not c.values:
                tds.append('<td class="none">—</td>')
                continue
            hw = "" if c.half_width is None else " " + half_width_text(c.half_width, spec_for("test/acc"))
            mark = {"win": " ★", "tie": " ="}.get(c.verdict, "")
            lr = f"lr {c.lr:g}" if isinstance(c.lr, int | float) else ""
            shade = max(0.0, min(1.0, c.mean))
            tds.append(
                f'<td class="{e(c.verdict)}" style="background: rgba(46, 125, 50, {0.08 + 0.5 * shade:.2f})">'
                f"<b>{_pct(c.mean)}</b>{e(hw)}{mark}<br><small>n={len(c.values)} · {e(lr)}</small></td>"
            )
        rows.append("<tr>" + "".join(tds) + "</tr>")
    chance = []
    for task in tasks:
        values = [c.chance for c in cells if c.task == task and c.chance is not None]
        chance.append(f"<td>{_pct(values[0])}</td>" if values else "<td>—</td>")
    head = "".join(f"<th>{e(t)}</th>" for t in tasks)
    took = f" · {seconds / 60:.0f} min" if seconds else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<title>attnlab capability card</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; max-width: 1300px; }}
table {{ border-collapse: collapse; }} th, td {{ border: 1px solid #ccc; padding: 6px 10px; text-align: center; }}
td.win {{ outline: 2px solid #1b5e20; }} td.none {{ color: #999; }} small {{ color: #555; }}
.wrap {{ overflow-x: auto; }}
</style></head><body>
<h1>Capability card</h1>
<p>MAD's synthetic tasks (Poli et al. 2024). Each cell: the mean test accuracy over seeds ± the 95 % t interval,
every variant at its own best learning rate (tuned on the validation accuracy of a separate seed){took}.
★ wins the task: the best mean, and its paired difference over the common seeds beats every other variant's
(paired t-test, Holm-corrected over the comparisons, α = 0.05). = ties: the best mean and the variants it does not
beat.</p>
<div class="wrap"><table>
<tr><th>variant</th>{head}</tr>
{"".join(rows)}
<tr><th><small>chance</small></th>{"".join(chance)}</tr>
</table></div>
</body></html>
"""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else "—"


GRACE_S = 60.0
"""How long a stopped card waits for the running sweep to end after passing the signal on, before killing it."""


class _Stop:
    """The signal that stopped the card (None while none came), passed on to the running sweep."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at = 0.0
        self.child: subprocess.Popen[bytes] | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()
        child = self.child
        if child is not None and child.poll() is None:
            with contextlib.suppress(OSError):
                child.send_signal(signum)


def _run_task(command: list[str], stop: _Stop) -> int:
    """Run one task's sweep; when the card is stopped, the sweep gets the signal and :data:`GRACE_S` to end (its
    report, its jobs interrupted and resumable), then it and what it started are killed."""
    if stop.signum is not None:
        return 130
    child = subprocess.Popen(command, start_new_session=True)  # (a terminal's Ctrl-C reaches it through the card)
    stop.child = child
    try:
        while True:
            try:
                return child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if stop.signum is not None and time.monotonic() - stop.at > GRACE_S:
                    with contextlib.suppress(OSError):
                        os.killpg(child.pid, signal.SIGKILL)
                    return child.wait()
    finally:
        stop.child = None
        if stop.signum is not None:  # anything the sweep started and left behind (a launcher's workers)
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGTERM)


def _check_outputs(out: Path) -> str | None:
    """Why the card could not write its files in ``out`` (a folder where card.csv or card.html should be), or None."""
    from attnlab.runs import is_odd

    if out.exists() and not out.is_dir():
        return f"--out {out} is not a folder"
    for name in ("card.csv", "card.html"):
        path = out / name
        if path.is_dir() or is_odd(path):
            return f"{path} is a folder, a link or not a regular file: the card never writes through it"
    return None


def _dry_run(tasks: Sequence[str], commands: Sequence[list[str]]) -> int:
    """``--dry-run``: each task's tuned sweep planned and estimated as ``train.py --dry-run`` plans it
    (:mod:`attnlab.training.plan`), then the card's total; nothing is run or written (but the step-time cache)."""
    from attnlab.training.config import ConfigError
    from attnlab.training.plan import START_S, minutes, plan_command, print_plan

    total, jobs, at_once = 0.0, 0, 1
    for k, (task, command) in enumerate(zip(tasks, commands, strict=True), 1):
        argv = command[command.index("-m") :]  # (after the interpreter and its -c)
        try:
            plan = plan_command(argv, log=lambda m: print(m, file=sys.stderr, flush=True))
        except ConfigError as exc:
            print(f"error: task {task}: {exc}", file=sys.stderr)
            return 2
        print(f"card: task {k}/{len(tasks)}: {task}")
        print_plan(plan, "train.py " + " ".join(argv))
        total += plan.seconds - START_S  # (its jobs, as many at a time as --jobs)
        jobs += len(plan.jobs)
        at_once = plan.parallel
    print(
        f"card: {jobs} jobs in {len(tasks)} tasks, estimated {minutes(total + START_S)} "
        f"({total / 60 + START_S / 60:.1f} min, {at_once} job(s) at a time)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnlab.card``: run the card (or ``--report`` only) and write its page and CSV."""
    from attnlab.console import printable

    parser = argparse.ArgumentParser(prog="python -m attnlab.card", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants",
        default=",".join(default_variants()),
        help="comma-separated named models: variants and the forms' named settings (gated_deltanet_beta2); "
        "python -m attnlab.compare lists them",
    )
    parser.add_argument("--tasks", default=",".join(CARD_TASKS), help="comma-separated card tasks")
    parser.add_argument("--out", default="card", help="the card's folder (default: card/)")
    parser.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)), help="comparison seeds (default 1,2,3)")
    parser.add_argument("--lr", default=",".join(format(g, "g") for g in DEFAULT_GRID), help="the lr grid")
    parser.add_argument("--jobs", type=int, default=2, help="jobs at a time (joblib; 1: in one process)")
    parser.add_argument("--report", action="store_true", help="only rewrite card.html and card.csv from --out")
    parser.add_argument(
        "--dry-run", action="store_true", help="print every task's jobs and their estimated minutes; run nothing"
    )
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every job (max_steps=600 ...)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    variants = [v for v in args.variants.split(",") if v]
    tasks = [t for t in args.tasks.split(",") if t]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
        grid = [float(g) for g in args.lr.split(",") if g]
    except ValueError as exc:
        print(f"error: --seeds takes integers and --lr numbers, comma-separated ({exc})", file=sys.stderr)
        return 2
    if not all(math.isfinite(g) for g in grid):
        print(f"error: --lr takes finite numbers, got {args.lr!r}", file=sys.stderr)
        return 2
    from attnlab.tasks import list_tasks
    from attnlab.training.compare import variant_options

    unknown = [t for t in tasks if t not in list_tasks()]
    known_variants = variant_options()  # (the yamls and the forms' named settings: gated_deltanet_beta2)
    unknown += [v for v in variants if v not in known_variants]
    if unknown or not variants or not tasks or not seeds or not grid:
        what = f"unknown names: {', '.join(unknown)}" if unknown else "empty --variants, --tasks, --seeds or --lr"
        print(
            f"error: {what} (tasks: {', '.join(CARD_TASKS)}; variants: conf/variant/*.yaml and the forms' named "
            "settings, listed by python -m attnlab.compare)",
            file=sys.stderr,
        )
        return 2
    if args.dry_run:
        return _dry_run(tasks, [card_command(t, variants, out, seeds, grid, args.jobs, args.overrides) for t in tasks])
    bad_output = _check_outputs(out)
    if bad_output is not None:
        print(f"error: {printable(bad_output)}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    failed: list[str] = []
    stop = _Stop()
    if not args.report:
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for k, task in enumerate(tasks, 1):
                if stop.signum is not None:
                    break
                print(
                    f"card: task {k}/{len(tasks)}: {task} ({len(variants)} variants, "
                    f"{time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
                code = _run_task(card_command(task, variants, out, seeds, grid, args.jobs, args.overrides), stop)
                if code == 2 and stop.signum is None:
                    return 2  # a refused configuration: one line already printed
                if code != 0:
                    failed.append(task)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    problems: list[str] = []
    cells = collect(out, tasks, problems)
    for line in problems:
        print(f"warning: {printable(line)}", file=sys.stderr)
    if not args.report:  # a task whose sweep left a variant without any seed run that finished ok
        failed += [t for t in tasks if t not in failed and any(c.task == t and not c.values for c in cells)]
    csv_path, html_path = write_card(out, cells, None if args.report else time.perf_counter() - started)
    print(f"card: {html_path} and {csv_path} ({len(cells)} cells, {time.perf_counter() - started:.0f} s)")
    if stop.signum is not None:
        name = signal.Signals(stop.signum).name
        print(f"card: stopped by {name}: the card so far; start it again with the same --out to go on", file=sys.stderr)
        return 128 + stop.signum
    if failed:
        print(
            f"card: {', '.join(failed)}: a sweep failed, or a variant has no seed run that finished ok (see above)",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
