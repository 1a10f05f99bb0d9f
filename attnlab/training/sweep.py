"""Hydra callbacks around runs and sweeps: the run folder's parents are checked and remembered before Hydra makes
them, a multirun reports "job k/N done" after each job and a final table, and its exit code says whether a job
failed.

Jobs record themselves in the sweep's ``sweep.jsonl`` (:class:`attnlab.runs.SweepJournal`) from whichever process
ran them, so the count is right with parallel launchers (joblib). With submitit, the "job k/N" lines go to each
job's log in ``<sweep>/.submitit/``; the final table is printed by the launching process as always.

The multirun's state in this process, the "job k/N done" lines and the final report live in
:mod:`attnlab.training.multirun`, below the sweeper, the plan and the run that this module's callbacks call on (and
that import them); this module re-exports them.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from attnlab.console import printable
from attnlab.runs import SWEEP_FILE, SweepJournal, is_odd

# (the private names too, re-exported: the tests and scripts that read them here)
from attnlab.training.multirun import _estimate_line as _estimate_line
from attnlab.training.multirun import _estimated_left as _estimated_left
from attnlab.training.multirun import _estimates as _estimates
from attnlab.training.multirun import _job_number as _job_number
from attnlab.training.multirun import _jobs_table as _jobs_table
from attnlab.training.multirun import (
    _report,
    _state,
    created_dirs,
    failed_jobs,
    job_done,
    mark_signalled,
    missing_dirs,
    report_interrupted,
    signalled,
    varying_keys,
)
from attnlab.training.multirun import _varying as _varying

__all__ = [
    "RunFolderGuard",
    "SweepReport",
    "count_jobs",
    "created_dirs",
    "failed_jobs",
    "job_done",
    "mark_signalled",
    "missing_dirs",
    "report_interrupted",
    "signalled",
    "varying_keys",
]


def _check_can_create(path: Path) -> None:
    """Exit with one line (code 2) if ``path`` cannot be created: its nearest existing parent is not writable."""
    existing = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".attnlab-check-"):
            pass
    except OSError as exc:
        print(
            f"error: cannot create the output folder {path}: {existing} is not writable ({exc.strerror or exc})",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


class RunFolderGuard(Callback):
    """Before Hydra makes a single run's folder: check that it can be made (one line and exit 2, not Hydra's
    traceback) and note which folders it is about to create."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        path = Path(str(OmegaConf.select(config, "hydra.run.dir")))
        _check_can_create(path)
        _state["created"] = (path.absolute(), missing_dirs(path))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        _check_can_create(sweep)
        _check_sweep_files(sweep)


def _check_sweep_files(sweep: Path) -> None:
    """Exit with one line (code 2) if a file the sweep writes in its folder is a symbolic link or not a regular file
    (the journal and Hydra's ``multirun.yaml`` are never written through a link)."""
    for name in (SWEEP_FILE, f".{SWEEP_FILE}.lock", "multirun.yaml"):
        path = sweep / name
        if is_odd(path) or path.is_dir():
            what = "a symbolic link" if path.is_symlink() else "not a regular file"
            message = f"{path} is {what}: a sweep's files are never written through links"
            print(f"error: {printable(message)}", file=sys.stderr)
            raise SystemExit(2)


def count_jobs(config: DictConfig) -> int | None:
    """How many jobs the sweep will run: Optuna's ``n_trials``, the tuned sweeper's plan (less what a resumed sweep
    already finished), or the basic sweeper's product of the swept values (None when it cannot be told)."""
    sweeper = config.hydra.sweeper
    target = str(sweeper.get("_target_", ""))
    try:
        if "optuna" in target.lower():
            return int(sweeper.n_trials)
        if target.endswith("TunedSweeper"):
            from attnlab.training.tuned import plan_count

            return plan_count(config)
        if target.endswith("BasicSweeper"):
            from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
            from hydra.core.override_parser.overrides_parser import OverridesParser

            params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
            parsed = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
            return sum(len(batch) for batch in BasicSweeper.split_arguments(parsed, None))
    except Exception:  # the count is a courtesy: an override it cannot parse must not stop the sweep
        return None
    return None


def _quiet_optuna(config: DictConfig) -> None:
    """Optuna logs "A new study created" with colour codes even into a file, and alembic (which it imports) lists
    its plugins: keep both to warnings, through the plain log handlers."""
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if "optuna" in str(config.hydra.sweeper.get("_target_", "")).lower():
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        optuna.logging.disable_default_handler()
        optuna.logging.enable_propagation()


def _sweep_estimates(config: DictConfig) -> dict[str, float] | None:
    """Each job's estimated seconds (:func:`attnlab.training.plan.plan_command` on the sweep's own overrides; the
    step times from the cache, the models not in it timed now), or None when the plan cannot be made, or when
    ``ATTNLAB_SWEEP_ESTIMATE=0`` (a test suite or a script that starts many tiny sweeps: each estimate composes and
    builds every job once more)."""
    import os

    from attnlab.training.plan import plan_command

    if os.environ.get("ATTNLAB_SWEEP_ESTIMATE", "1") == "0":
        return None

    overrides = [*OmegaConf.select(config, "hydra.overrides.hydra", default=[]), *config.hydra.overrides.task]
    try:
        plan = plan_command(["-m", *[str(o) for o in overrides]], fresh=False)
    except (Exception, SystemExit):  # the estimate is a courtesy: the sweep goes on without it
        return None
    return plan.estimates() or None


class SweepReport(Callback):
    """At the start of a multirun, the journal's header (jobs expected); at its end, a table of the jobs (status,
    best val and test accuracy, wall time, reason) and "N ok, M failed". :func:`failed_jobs` then tells
    ``train.py`` to exit non-zero. The count comes from the journal before anything is printed, so that no failure
    of the report itself (a job folder's odd name, an unreadable summary) can turn a failed sweep's exit code into 0.
    A sweep stopped by Ctrl-C or SIGTERM gets the same report from :func:`report_interrupted`."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _quiet_optuna(config)
        _state["failed"] = 0
        _state["sweep"] = Path(config.hydra.sweep.dir)
        SweepJournal(config.hydra.sweep.dir).start(count_jobs(config), _sweep_estimates(config))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        _report(Path(config.hydra.sweep.dir))
        _state["sweep"] = None
