"""A multirun's state in this process and its journal's lines, below the Hydra callbacks of
:mod:`attnlab.training.sweep` (which re-exports these names): the run folders Hydra created, whether Ctrl-C or
SIGTERM arrived, "job k/N done" after each job with the time left from the per-job estimates, the final jobs table
and the failed count that ``train.py``'s exit code says; and whether a run ends with the head step (off by default
in a sweep).

Nothing here imports the sweeper, the plan or the run (:mod:`~attnlab.training.tuned`, :mod:`~attnlab.training.plan`,
:mod:`~attnlab.training.lifecycle`): they all import this module.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from attnlab.console import plain_console, printable
from attnlab.runs import RunFileError, RunFolder, SweepJournal
from attnlab.training.console import bpc, clock, stdout_gone

__all__ = [
    "created_dirs",
    "failed_jobs",
    "head_step_on",
    "job_done",
    "mark_signalled",
    "missing_dirs",
    "report_interrupted",
    "signalled",
    "varying_keys",
]

_state: dict[str, Any] = {"created": (None, []), "failed": 0, "sweep": None, "signalled": False}


def created_dirs(path: Path) -> list[Path]:
    """The folders that Hydra created for the run folder ``path`` (deepest first): a run refused before it started
    removes them again, so that bad input leaves nothing behind."""
    target, created = _state["created"]
    return list(created) if target is not None and target == Path(path).absolute() else []


def missing_dirs(path: Path) -> list[Path]:
    """``path`` (made absolute) and those of its parents that do not exist yet, deepest first."""
    path = Path(path).absolute()
    missing = []
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing.append(p)
    return missing


def mark_signalled() -> None:
    """Note that Ctrl-C or SIGTERM arrived (set by ``train.py``'s signal handler)."""
    _state["signalled"] = True


def signalled() -> bool:
    """Whether Ctrl-C or SIGTERM arrived in this process: a multirun's next job does not start."""
    return bool(_state.get("signalled"))


def job_done(job: str, status: str, reason: str | None, wall_time_s: float | None) -> None:
    """Record a finished job of the current multirun and print ``job k/N done (status), elapsed, time left``."""
    journal = SweepJournal(HydraConfig.get().sweep.dir)
    try:
        journal.record(job, status, reason, wall_time_s)
        header, jobs = journal.read()
    except RunFileError as exc:  # (the job's own folder has its result; the sweep goes on)
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return
    total, started = header.get("jobs"), header.get("started")
    done = len(jobs)
    line = f"job {done}/{total} done ({status})" if total else f"job {done} done ({status})"
    if started:
        elapsed = time.time() - started
        line += f", {clock(elapsed)} elapsed"
        if total and done < total:
            left = _estimated_left(header.get("estimates"), jobs)
            line += f", ~{clock(left)} left (estimated)" if left is not None else ""
    try:
        print(line, flush=True)
    except BrokenPipeError:  # stdout's reader has gone (| head): the job's record stands
        stdout_gone()


def _estimates(raw: Any) -> dict[int, float]:
    """The journal header's ``estimates`` as ``{job number: seconds}`` (a hand-edited header: what is not a
    number is left out)."""
    if not isinstance(raw, dict):
        return {}
    out = {}
    for key, value in raw.items():
        with contextlib.suppress(TypeError, ValueError):
            number, seconds = int(key), float(value)
            if seconds >= 0 and seconds == seconds and seconds != float("inf"):
                out[number] = seconds
    return out


def _estimated_left(raw: Any, jobs: list[dict[str, Any]]) -> float | None:
    """The seconds the jobs not yet recorded are estimated to take, from the per-job estimates made when the sweep
    started (None without them: then no "left" is printed rather than a mean of unlike jobs)."""
    estimates = _estimates(raw)
    if not estimates:
        return None
    done = {_job_number(job) for job in jobs}
    return sum(seconds for number, seconds in estimates.items() if number not in done)


def _job_number(job: dict[str, Any]) -> float:
    """The job's number, which begins its folder's name (``3_lr=0.01``: Hydra's job number, see conf/hydra; the tuned
    sweeper's ``tune/3_lr=0.01``); a job without one comes last."""
    match = re.match(r"(\d+)_", str(job.get("job")).rsplit("/", 1)[-1])
    return int(match.group(1)) if match else float("inf")


def _report(sweep: Path, interrupted: bool = False) -> None:
    """The jobs table (in job order) and "N ok, M failed" for the sweep folder ``sweep``; sets the failed count
    first."""
    header: dict[str, Any] = {}
    try:
        header, jobs = SweepJournal(sweep).read()
    except RunFileError as exc:
        jobs = []
        print(f"error: {exc}", file=sys.stderr)
    jobs = sorted(jobs, key=_job_number)  # (the journal has them in the order they finished)
    failed = [job for job in jobs if job.get("status") != "ok"]
    # a tuned sweep's grid point that failed (diverged at a high learning rate) is part of its protocol: it ranks
    # last, and the sweep's exit code stays 0 (see attnlab.training.tuned)
    counted = [job for job in failed if not str(job.get("job")).startswith("tune/")]
    _state["failed"] = len(counted) + (1 if interrupted else 0)
    console = plain_console()  # job folders, statuses and reasons are text, never markup
    try:
        if jobs:
            console.print(_jobs_table(sweep, jobs))
    except Exception as exc:  # the report is a courtesy; the count above is what the exit code says
        print(f"error: the sweep's table could not be printed ({type(exc).__name__}: {exc})", file=sys.stderr)
    ended = "interrupted: " if interrupted else ""
    console.print(f"sweep {sweep}: {ended}{len(jobs) - len(failed)} ok, {len(failed)} failed")
    line = _estimate_line(header, jobs)
    if line:
        console.print(line)
    for job in failed:
        ranked = " (a grid point: ranked last)" if job not in counted else ""
        console.print(f"  {job.get('status')}{ranked}: {job.get('job')}: {job.get('reason')}")


def _estimate_line(header: dict[str, Any], jobs: list[dict[str, Any]]) -> str | None:
    """``time: estimated 12:10 for the 6 jobs, took 10:05 (0.83× the estimate)``: the per-job estimates made at the
    start against the jobs' wall times, over the jobs that ran and have both."""
    estimates = _estimates(header.get("estimates"))
    pairs = [
        (estimates[n], float(job["wall_time_s"]))
        for job in jobs
        if (n := _job_number(job)) in estimates and isinstance(job.get("wall_time_s"), int | float)
    ]
    if not pairs:
        return None
    estimated, actual = sum(e for e, _ in pairs), sum(a for _, a in pairs)
    ratio = f" ({actual / estimated:.2f}× the estimate)" if estimated > 0 else ""
    return f"time: estimated {clock(estimated)} for the {len(pairs)} job(s), took {clock(actual)}{ratio}"


def _jobs_table(sweep: Path, jobs: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title=f"sweep {sweep}", title_justify="left")
    rows, models, headlines = [], [], []
    for job in jobs:
        metrics: dict[str, Any] = {}
        model = headline = None
        name = str(job.get("job"))
        inside = not Path(name).is_absolute() and ".." not in Path(name).parts  # (the journal is a file too)
        with contextlib.suppress(RunFileError, OSError, ValueError, TypeError):
            summary = RunFolder(sweep / name).read_summary() if inside else None
            metrics = summary.metrics if summary else {}
            model = summary.model if summary else None
            headline = summary.headline_metric if summary else None
        rows.append((job, metrics))
        models.append(model)
        headlines.append(headline)
    bits = any(metrics.get("test/bpc") is not None for _, metrics in rows)  # a language-modelling task (task=text)
    labels = [
        (number, _named_model(label, model))
        for (number, label), model in zip(_varying(str(job.get("job")) for job, _ in rows), models, strict=True)
    ]
    # the task's headline metric (summary.json headline_metric: test/acc@128 for a state-tracking task tested
    # beyond its training length), first, where it is not one of the columns already
    named = sorted({h for h in headlines if h and h not in ("test/acc", "test/bpc")})
    shown = named[0].removeprefix("test/").replace("acc", "test acc", 1).replace("bpc", "test bpc", 1) if named else ""
    star = [f"★ {shown}"] if len(named) == 1 else []
    star = star or (["★ headline"] if named else [])
    table.add_column("job", justify="right", no_wrap=True)
    table.add_column("varying keys", justify="left", overflow="fold")  # (never cut: folded onto more lines)
    for col in ("status", *star, "best val acc", "test acc", *["test bpc"] * bits, "wall time"):
        table.add_column(col, justify="left" if col == "status" else "right", no_wrap=True)
    for (job, metrics), (number, label), headline in zip(rows, labels, headlines, strict=True):
        wall = job.get("wall_time_s")
        value = metrics.get(headline) if headline and (len(named) != 1 or headline == named[0]) else None
        cell = "-" if value is None else bpc(metrics, headline) if "bpc" in headline else f"{100 * value:.1f}%"
        if len(named) > 1 and headline:
            cell += f" ({headline})"
        table.add_row(
            number,
            label,
            str(job.get("status")),
            *([cell] if star else []),
            *(f"{100 * metrics[k]:.1f}%" if metrics.get(k) is not None else "-" for k in ("val/acc_best", "test/acc")),
            *[bpc(metrics, "test/bpc")] * bits,
            f"{wall:.1f} s" if isinstance(wall, int | float) else "-",
        )
    return table


def _named_model(label: str, model: str | None) -> str:
    """A job's label with a comparison's model named as the run recorded it: ``model=kda_beta2`` for the folder's
    ``compare=state_tracking_kda_beta2`` (whose ``/`` a folder name cannot hold)."""
    if model is None:
        return label
    return " ".join(f"model={model}" if part.startswith("compare=") else part for part in label.split(" "))


def varying_keys(pairs: list[dict[str, str]]) -> list[str]:
    """The keys whose values differ between the jobs' ``{key: value}`` (a key a job lacks differs), in the order the
    jobs first name them; every key when none differs (one job, or identical jobs)."""
    keys: list[str] = []
    for p in pairs:
        keys += [k for k in p if k not in keys]
    return [k for k in keys if len({p.get(k) for p in pairs}) > 1] or keys


def _varying(names: Any) -> list[tuple[str, str]]:
    """(number, varying keys) of each job folder name ``[stage/]N_k=v,k=v``: the keys whose values differ between
    the jobs, in the order the first job names them, ``variant`` first (the whole name when it cannot be read)."""
    parsed = []
    for name in names:
        stage, _, leaf = name.rpartition("/")
        number, sep, rest = leaf.partition("_")
        pairs = dict(p.split("=", 1) for p in rest.split(",") if "=" in p) if sep and number.isdigit() else None
        parsed.append((f"{stage}/{number}" if stage else number, pairs, name))
    readable = [p for _, p, _ in parsed if p is not None]
    varying = sorted(varying_keys(readable), key=lambda k: k != "variant")
    out = []
    for number, pairs, name in parsed:
        if pairs is None:
            out.append(("", name))
        else:
            out.append((number, " ".join(f"{k}={pairs[k]}" for k in varying if k in pairs) or "(the defaults)"))
    return out


def report_interrupted() -> bool:
    """After Ctrl-C or SIGTERM stopped a multirun: its report (what finished, what failed), once. False when no
    multirun was under way."""
    sweep = _state.get("sweep")
    if sweep is None:
        return False
    _state["sweep"] = None
    _report(sweep, interrupted=True)
    return True


def failed_jobs() -> int:
    """How many jobs of the multirun that just ended did not finish ok."""
    return int(_state["failed"])


def new_command() -> None:
    """Forget what a command run before in this process left (its failed jobs, its signal): a second
    :func:`attnlab.training.cli.main` in one process (a notebook, a test) is judged by its own jobs."""
    _state["failed"], _state["signalled"], _state["sweep"] = 0, False, None


def head_step_on(cfg: DictConfig, multirun: bool) -> bool:
    """Whether the run ends with the head step (head importance and the pruning curves): ``diagnostics.importance``
    true, or ``auto`` (the default) in a single run that is not a smoke run (``debug=fast``). In a sweep the step
    took up to 40 % of a job (issue 40: 220 s of a 523 s additive run), so ``auto`` leaves it to the runs that ask."""
    d = cfg.diagnostics
    if not d.get("enabled", True):
        return False
    value = d.get("importance", "auto")
    if value == "auto":
        return not (multirun or bool(cfg.get("smoke")))
    return bool(value)
