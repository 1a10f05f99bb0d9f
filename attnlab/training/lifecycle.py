"""The life of one run: check, lock, start, fit, test, finish. :func:`run` reads as that list of steps.

Guarantees (the README's "Runs and resuming" section states them for users):

* Nothing is written before the whole config is valid (after the user's ``imports`` ran), its budgets resolved
  (``max_tokens`` into ``max_steps``, ``match`` into the model's width). A single run refused
  there prints one line and exits 2; the folders Hydra made for it are removed. In a multirun the job is
  recorded as failed in its own (new) folder and the sweep goes on.
* One process writes a run folder at a time (:meth:`attnlab.runs.RunFolder.lock`).
* A folder that holds a run is never started again without ``resume=true`` (continue it) or ``overwrite=true``
  (replace it). A resume must have the settings the run was started with (logger, threads and the like may
  differ); a larger ``max_steps`` extends a run (its learning-rate schedule stays that of the original
  ``max_steps``: the extra steps run at its final rate). A finished run asked to resume is left untouched.
* config.yaml is written once. summary.json keeps one segment per start. A failure before the start touches no
  existing file.
* Interrupted (SIGINT, SIGTERM): ``status: interrupted`` and the resume command. Killed (SIGKILL): the summary
  still says ``running`` and readers report it as interrupted. Either way, ``resume=true`` continues from
  ``last.ckpt`` and ends with exactly the metrics of an uninterrupted run of the same seed (CPU).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnlab.runs import RunFileError, RunFolder, RunFolderBusy, Segment, Summary, utc_now
from attnlab.training.config import (
    EXTENSION_KEYS,
    ConfigError,
    attention_configs,
    base_attention,
    check_resolves,
    config_changes,
    import_user_modules,
    plain,
    resolve_d_k,
    resolve_match,
    validate_config,
)

__all__ = ["run"]


def run(cfg: DictConfig, output_dir: str | Path | None = None) -> float:
    """Train and test one configuration in the run folder ``output_dir`` (default: Hydra's run folder); return
    ``cfg.optimized_metric`` (for sweepers: the worst value for their direction when the run failed).

    A single run that cannot start exits with code 2, one that fails with 1, an interrupted one with 130, each
    after one line on stderr; in a multirun (or when ``output_dir`` is given) the job returns instead, so that a
    sweep goes on. ``HYDRA_FULL_ERROR=1`` re-raises with the traceback.
    """
    return Run(cfg, output_dir).execute()


def _rank() -> int:
    """This process's rank, read as Lightning reads it (its launcher sets these before re-running train.py)."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def _hydra() -> Any:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def _task_options(cfg: DictConfig) -> dict[str, Any]:
    """The run's ``task.datamodule`` options, resolved, without ``_target_`` and ``test_lengths`` (what the dashboard
    passes a task's :meth:`~attnlab.tasks.SequenceTask.headline_metric` from a run's config, so that both name the
    same metric)."""
    node = OmegaConf.select(cfg, "task.datamodule", default=None)
    options = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else {}
    return {str(k): v for k, v in (options or {}).items() if k not in ("_target_", "test_lengths")}


def _model_name(cfg: DictConfig) -> str | None:
    """The run's model name (:func:`attnlab.training.compare.model_name`: a comparison's model, the ``variant=``
    choice, or ``variant.name``); None where the config does not say."""
    from attnlab.training.compare import model_name

    hydra = _hydra()
    choice = hydra.runtime.choices.get("variant") if hydra is not None else None
    try:
        return model_name(cfg, None if choice is None else str(choice))
    except Exception:  # (a config that failed validation: the summary's other fields are null the same way)
        return None


def _is_multirun() -> bool:
    from hydra.types import RunMode

    hc = _hydra()
    return hc is not None and hc.mode == RunMode.MULTIRUN


def _one_line(exc: BaseException) -> str:
    """The exception as one line; our own errors are sentences already, others get their type in front."""
    own: tuple[type, ...] = (ConfigError, RunFolderBusy, RunFileError)
    if "attnlab.callbacks" in sys.modules:  # (not imported before the config was valid: keeps refusals fast)
        own += (sys.modules["attnlab.callbacks"].DivergenceError,)
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, own) else f"{type(exc).__name__}: {text}"


def _n(count: Any, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _first(counts: Any) -> int | None:
    """The batches the trainer ran of its first loader (``trainer.num_test_batches``: a list per loader), or None
    when it does not say (then every batch)."""
    if isinstance(counts, list | tuple) and counts and isinstance(counts[0], int | float):
        return int(counts[0]) if math.isfinite(counts[0]) else None
    return None


def shown(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _failed_value() -> float:
    """What a failed job returns to Hydra: the worst value for the sweeper's ``direction`` (Optuna 2.x stops the
    whole sweep on NaN: it rejects the value, then the sweeper's own error handling raises), else NaN."""
    from omegaconf import ListConfig

    hc, direction = _hydra(), None
    if hc is not None:
        direction = hc.sweeper.get("direction")
        if isinstance(direction, ListConfig | list | tuple):
            direction = direction[0] if len(direction) == 1 else None
    direction = str(getattr(direction, "name", direction)).lower()
    return {"maximize": float("-inf"), "minimize": float("inf")}.get(direction, float("nan"))


class Run:
    """One run's state across its steps. Use :func:`run`."""

    def __init__(self, cfg: DictConfig, output_dir: str | Path | None) -> None:
        from attnlab.training.multirun import created_dirs, missing_dirs

        hc = _hydra()
        path = Path(output_dir) if output_dir is not None else Path(hc.runtime.output_dir)
        self.cfg = cfg
        self.folder = RunFolder(path)
        self.in_process = output_dir is not None
        self.multirun = _is_multirun()
        self.writer = _rank() == 0  # with several processes only rank 0 writes the folder
        self.created = created_dirs(path) if output_dir is None else missing_dirs(path)
        # (as written: an override's value is data here, never resolved, ${...} included)
        self.overrides = [str(o) for o in OmegaConf.to_container(hc.overrides.task)] if hc is not None else []
        self.started_at = time.perf_counter()
        self.started = False  # True once the folder has been written to
        self.complete = False
        self.previous: Summary | None = None
        self.kind = "new"  # new | resume | extend
        self.ckpt_path: Path | None = None
        self.schedule_steps: int | None = None
        self.rows_floor = 0
        self.summary = Summary()
        self.segment: Segment | None = None
        self.trainer: Any = None
        self.deterministic_before: tuple[bool, bool, bool] | None = None  # torch's, before compile=true set them
        self.matched: dict[str, Any] | None = None  # what match sized (resolve_match)
        self.timer: Any = None  # the StepTimer callback
        self.pruning: dict[str, Any] | None = None  # pruning.json's content, once the head step ran
        self.prune_metrics: dict[str, float] = {}  # its prune/auc_* for the summary
        from attnlab.training.console import RunLog

        self.log = RunLog(enabled=self.writer)

    # ============================================================================ the steps

    def execute(self) -> float:
        from attnlab.training.multirun import signalled

        try:
            if self.multirun and signalled():  # Ctrl-C came while Python could not raise it: no further job
                raise KeyboardInterrupt
            self.validate()  # 1. the user's imports, then the whole config: nothing written yet
            with self.hold_folder():  # 2. one writer per folder (a fresh folder is made here)
                self.inspect_folder()  # 3. new run, resume, extension, or a finished run? (reads only)
                if self.complete:
                    return self.report_complete()
                self.prepare()  # 4. data, model, checkpoint, trainer: built and checked, nothing written
                self.start()  # 5. config.yaml (new runs), summary "running", train.log
                self.fit()  # 6. train, from the last checkpoint when resuming
                self.test()  # 7. test the best checkpoint
                self.heads()  # 8. head importance and pruning curves (pruning.json)
                return self.finish()  # 9. summary "ok", results table, run folder
        except (ConfigError, RunFolderBusy, RunFileError) as exc:
            return self.refuse(exc)
        except (KeyboardInterrupt, SystemExit) as exc:
            return self.interrupted(exc)
        except Exception as exc:
            if _from_signal(exc):  # the interruption, turned into another error on its way out (said, not hidden)
                self.log.info(f"stopped by a signal; on the way out: {_one_line(exc)}")
                return self.interrupted(exc)
            return self.fail(exc)
        finally:
            self._restore_deterministic()
            self.log.close()

    def validate(self) -> None:
        check_resolves(self.cfg)  # (imports=${undefined} too: one line)
        if self.resuming:
            self._check_stored_imports()  # the folder is data: its imports run only when the command line asks
        import_user_modules(self.cfg)
        self.datamodule = validate_config(self.cfg)
        self.matched = resolve_match(self.cfg, self.datamodule)  # match: the model sized to a count, in the config
        if self.matched is not None:
            self.datamodule = validate_config(self.cfg)  # (the sized model checked again: memory, sizes)

    @property
    def resuming(self) -> bool:
        return bool(self.cfg.get("resume")) or self.cfg.get("ckpt_path") == "last"

    def _check_stored_imports(self) -> None:
        """A run folder is data, never code: the modules its config.yaml lists under ``imports`` are imported only
        when the command line names the same ones (read as data, before anything is imported)."""
        folder = self.folder
        if not os.path.lexists(folder.config_path):
            return
        stored = self._read(folder.read_config).get("imports") or []
        given = plain(self.cfg.get("imports")) or []
        if stored and stored != given:  # (other imports than the run had: the settings check names the change)
            shown_stored = "[" + ",".join(str(m) for m in stored) + "]" if isinstance(stored, list) else repr(stored)
            raise ConfigError(
                f"the run in {shown(folder.path)} was started with imports={shown_stored}, and a resume never "
                f"imports code that a run folder names: if you trust these modules, add 'imports={shown_stored}' "
                "to the command line" + (f" (it has imports={given})" if given else "")
            )

    @contextlib.contextmanager
    def hold_folder(self) -> Iterator[None]:
        """The folder's lock for the block (rank 0). A run that ends before it started removes the folders made
        for it while it still holds the lock, so that no other process can take the lock file in between."""
        if not self.writer:
            yield
            return
        command = " ".join(["train.py", *self.overrides]) if self.overrides else "attnlab run"
        with self.folder.lock(command):
            try:
                yield
            except BaseException:
                if not self.started and not self.multirun:
                    self._remove_created_dirs()
                raise

    def inspect_folder(self) -> None:
        """Decide what this start is; refuse (:class:`ConfigError`) what the folder does not allow."""
        cfg, folder = self.cfg, self.folder
        resume = self.resuming
        if resume and cfg.overwrite:
            raise ConfigError("resume=true and overwrite=true contradict each other: continue the run, or replace it")
        explicit = None if cfg.get("ckpt_path") in (None, "last") else Path(cfg.ckpt_path)
        if cfg.overwrite and explicit is not None and folder.relative(explicit) != str(explicit):
            raise ConfigError(
                f"overwrite=true deletes the run in {shown(folder.path)}, and ckpt_path={explicit} lies inside it: "
                "copy the checkpoint elsewhere first"
            )
        if not self.writer:  # rank > 0: rank 0 decided; follow the same checkpoint
            self.ckpt_path = folder.checkpoint("last") if resume else explicit
            self.schedule_steps = self._stored_max_steps() if resume else None
            return
        folder.check_entries()  # no file of a run folder is read or written through a link, and no FIFO read
        if cfg.overwrite and folder.has_entries() and not folder.is_run():
            raise ConfigError(
                f"overwrite=true deletes a run, and {shown(folder.path)} holds no run that attnlab recognises (no "
                "summary.json with a schema_version) but files a run would write (config.yaml, checkpoints/, wandb/ "
                "...): nothing was removed; use another folder, or remove those files yourself"
            )
        if not folder.holds_run() or cfg.overwrite:
            if resume and not folder.holds_run():
                raise ConfigError(
                    f"nothing to resume in {shown(folder.path)}: it holds no run (resume=true continues the run in "
                    "hydra.run.dir=<its folder>)"
                )
            self.ckpt_path = explicit
            return
        previous = self._read(folder.read_summary)
        if not resume:
            state = f"{previous.status}, step {previous.steps}" if previous else "no summary"
            raise ConfigError(
                f"{shown(folder.path)} already holds a run ({state}); to continue it: python train.py resume=true "
                f"hydra.run.dir={shown(folder.path)} ; to replace it, add overwrite=true"
            )
        stored = self._read(folder.read_config)
        changes = config_changes(stored, plain(cfg))
        fixed = [c for c in changes if c[0] not in EXTENSION_KEYS]
        if fixed:
            listed = ", ".join(f"{key}: {old!r} → {new!r}" for key, old, new in fixed[:6])
            more = f" and {len(fixed) - 6} more" if len(fixed) > 6 else ""
            raise ConfigError(
                f"cannot resume {shown(folder.path)} with other settings than it was started with: {listed}{more} "
                "(only logger, threads, results_table and the like may differ; a larger max_steps extends the run)"
            )
        original = stored.get("max_steps")
        if not isinstance(original, int):
            raise ConfigError(f"cannot use the run in {shown(folder.path)}: its config.yaml has no max_steps")
        self._check_not_shortened(original, previous)
        self.previous = previous
        if previous is not None and previous.finished and (previous.steps or 0) >= cfg.max_steps:
            self.complete = True
            return
        last = folder.checkpoint("last")
        # no checkpoint yet (stopped before its first validation): the resume trains from step 0 in the same folder
        self.ckpt_path = last if last.exists() else None
        self.kind = "extend" if cfg.max_steps > original else "resume"
        self.schedule_steps = original
        if previous is not None:
            self.summary = previous
            self.rows_floor = folder.metrics().rows if previous.finished else previous.metrics_rows_floor

    def _check_not_shortened(self, original: int, previous: Summary | None) -> None:
        """Refuse a ``max_steps`` below any step the run reached or any segment set out to reach and was
        interrupted on the way (an extension to 500 killed at 400 cannot be resumed as a 300-step run)."""
        reached, target = original, None
        if previous is not None:
            reached = max(reached, previous.steps or 0, *(seg.to_step or 0 for seg in previous.segments))
            unfinished = [seg for seg in previous.segments if seg.status != "ok" and seg.target_steps]
            target = max((seg.target_steps for seg in unfinished), default=None)
        if self.cfg.max_steps < reached:
            aim = f", and an extension to {target} was interrupted" if target and target > reached else ""
            raise ConfigError(
                f"max_steps {reached} → {self.cfg.max_steps}: a run cannot be shortened (the run in "
                f"{shown(self.folder.path)} reached step {reached}{aim}; resume with max_steps >= {reached}, or leave "
                "max_steps out)"
            )

    def report_complete(self) -> float:
        summary = self.previous
        self.log.info(
            f"run {shown(self.folder.path)} is complete ({summary.steps} steps); nothing to do, nothing changed. "
            "To train it further: resume=true max_steps=<more>"
        )
        from attnlab.training.console import results_table

        self.log.table(results_table(summary))
        if self.multirun:
            self._record_job("ok", None)
        value = summary.metrics.get(self.cfg.optimized_metric)
        return float("nan") if value is None else float(value)

    def prepare(self) -> None:
        """Build everything the run needs and check what can fail before anything is written."""
        import lightning as L
        from hydra.utils import instantiate

        from attnlab.callbacks import AttentionDiagnostics, DivergenceGuard
        from attnlab.training.checkpoints import (
            AtomicCheckpointIO,
            RunState,
            check_fits,
            check_writable,
            make_checkpoints,
            read_checkpoint,
        )
        from attnlab.training.config import build_module, set_threads
        from attnlab.training.console import quiet_libraries
        from attnlab.training.data import prepare_loaders
        from attnlab.training.loggers import wandb_run_id
        from attnlab.training.progress import StepProgress, StepTimer

        cfg = self.cfg
        quiet_libraries()  # after Lightning's import, which sets its own log level
        self.threads = set_threads(cfg)
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        self.datamodule.setup("fit")
        prepare_loaders(self.datamodule)
        self.module = build_module(cfg, self.datamodule, self.schedule_steps)
        self.ckpt = None
        if self.ckpt_path is not None:
            self.ckpt = read_checkpoint(self.ckpt_path)
            check_fits(self.module, self.ckpt, self.ckpt_path)
            if self.writer and int(self.ckpt["global_step"]) > cfg.max_steps:  # whatever the summary says
                self._check_not_shortened(int(self.ckpt["global_step"]), self.previous)

        best, last = make_checkpoints(self.folder)
        self.wandb_id = wandb_run_id(self.folder, resume=self.kind != "new")
        self.state = RunState(None)  # its metrics.jsonl logger comes with the loggers, at the start
        self.diagnostics = None
        trainer_cfg = plain(cfg.trainer)
        live = bool(trainer_cfg.pop("enable_progress_bar", True))  # our bar replaces Lightning's; false: lines only
        progress = StepProgress(self.log, cfg.max_steps, live=live)
        self.timer = StepTimer()  # first: its end of a batch comes before the other callbacks' work
        callbacks: list[Any] = [self.timer, self.state, best, DivergenceGuard(), progress]
        if cfg.diagnostics.enabled:
            d = cfg.diagnostics
            self.diagnostics = AttentionDiagnostics(
                d.every_n_steps,
                d.probe_size,
                d.threshold,
                d.heatmaps,
                self.folder.attention_dir,
                heads=d.heads,
                window=d.window,
                near_keys=d.near_keys,
            )
            callbacks.append(self.diagnostics)
        callbacks.append(last)
        try:
            self.trainer = instantiate(
                trainer_cfg,
                logger=False,
                callbacks=callbacks,
                default_root_dir=str(self.folder.path),
                plugins=[AtomicCheckpointIO()],
            )
        except Exception as exc:  # Lightning's misconfiguration messages are long; one line is enough here
            raise ConfigError(f"trainer: {_one_line(exc)}") from None
        self._check_launch()
        if self.writer:
            check_writable(self.folder.checkpoint_dir)

    def start(self) -> None:
        """From here on the folder is written: config.yaml (new runs only), summary "running", train.log."""
        from attnlab.training.loggers import make_loggers

        cfg, folder = self.cfg, self.folder
        step = int(self.ckpt["global_step"]) if self.ckpt is not None else 0
        self._begin_summary(step)
        self.started = True
        if self.writer:
            if cfg.overwrite and self.kind == "new":
                folder.remove_run()
            folder.remove_partial_files()
            if self.kind == "new":
                folder.write_config(plain(cfg))
            folder.write_summary(self.summary)
            self.log.open(folder.log_path)
        hc = _hydra()
        name = (hc.job.override_dirname if hc else "") or folder.path.name
        group = Path(hc.sweep.dir).name if self.multirun else None
        self.loggers = make_loggers(cfg, folder, self.wandb_id, name, group)  # W&B writes wandb_id.txt here
        self.trainer.loggers = self.loggers
        self.state.jsonl = self.loggers[0]
        self._truncate_metrics()
        self.log.info(self._start_line(step))

    def fit(self) -> None:
        from attnlab.training.checkpoints import close_restored_loops

        ckpt = str(self.ckpt_path) if self.ckpt_path is not None else None
        self._compile()
        self.trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=ckpt, weights_only=True)
        if self.ckpt is not None and int(self.ckpt["global_step"]) >= self.cfg.max_steps:
            close_restored_loops(self.trainer)  # nothing was left to train: the run was killed during its test
        self.state.apply_restored(self.module)  # (a fit with nothing left to train never starts training)
        self.fit_metrics = {**self.state.metrics, **self._callback_metrics()}
        self.diag = self.diagnostics.results() if self.diagnostics is not None else None
        for note in self.diagnostics.notes if self.diagnostics is not None else []:
            self.log.info(f"diagnostics: {note}")

    def test(self) -> None:
        best = self.folder.checkpoint("best")
        ckpt = str(best) if best.exists() else None
        self.trainer.test(self.module, datamodule=self.datamodule, ckpt_path=ckpt, verbose=False, weights_only=True)

    def heads(self) -> None:
        """Head importance on the validation set and the pruning curves on the test set, with the weights the test
        used (:mod:`attnlab.heads`): per-head ``attn/L{l}H{h}/importance`` and ``prune/auc_*`` logged,
        ``pruning.json`` written. Rank 0 only, with ``diagnostics.enabled`` and ``diagnostics.importance``."""
        d = self.cfg.diagnostics
        from attnlab.training.multirun import head_step_on

        if not (self.writer and d.enabled):
            return
        if not head_step_on(self.cfg, self.multirun):
            if d.importance == "auto":
                where = "a sweep" if self.multirun else "a smoke run"
                self.log.info(f"head importance and pruning: off in {where} (diagnostics.importance=true turns it on)")
            return
        from attnlab.training.heads import prune_heads

        started = time.perf_counter()
        module = self.module
        heads = len(module.encoder.layers) * module.encoder.num_heads
        self.log.info(f"head importance and pruning: {heads} heads, {1 + heads} test points per order ...")
        limits = [_first(getattr(self.trainer, f"num_{split}_batches", None)) for split in ("val", "test")]
        with self.trainer.precision_plugin.forward_context(), self._head_bar() as progress:
            self.pruning, logged = prune_heads(
                module, self.datamodule, self.cfg.seed, int(d.random_orders), *limits, progress=progress
            )
        self.prune_metrics = {k: v for k, v in logged.items() if k.startswith("prune/")}
        for logger in self.loggers:
            logger.log_metrics(logged, step=self.trainer.global_step)
        self._log_pruning_table()
        self.folder.write_pruning(self.pruning)
        auc = self.pruning["auc"]
        shown_auc = ", ".join(f"{k} {v:.4g}" for k, v in auc.items())
        self.log.info(
            f"pruning.json: mean {self.pruning['metric']} over the curve: {shown_auc} "
            f"({time.perf_counter() - started:.1f} s)"
        )

    @contextlib.contextmanager
    def _head_bar(self) -> Iterator[Any]:
        """A live bar over the pruning curves' test points on a terminal (none in a file or a log), yielding its
        ``progress(done, total)``."""
        console = self.log.console
        live = bool(self.cfg.trainer.get("enable_progress_bar", True))
        if not (live and self.log.enabled and console.is_terminal):
            yield None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(
            TextColumn("pruning curves"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            console=console, transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task("pruning", total=None)
            yield lambda done, total: bar.update(task, completed=done, total=total)

    def _log_pruning_table(self) -> None:
        """The pruning curves as one W&B table (order, heads removed, metric), where W&B logs."""
        from lightning.pytorch.loggers import WandbLogger

        rows = [
            [order, int(point["removed"]), point[self.pruning["metric"]]]
            for order, curves in self.pruning["curves"].items()
            for curve in curves
            for point in curve
        ]
        for logger in self.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table("prune/curves", columns=["order", "removed", self.pruning["metric"]], data=rows)

    def finish(self) -> float:
        from attnlab.training.console import results_line, results_table
        from attnlab.training.loggers import finish_wandb

        finish_wandb(failed=False)
        metrics = {**self.fit_metrics, **self._callback_metrics()}
        if "val/acc_best" not in metrics and "val/acc" in metrics:
            metrics["val/acc_best"] = metrics["val/acc"]
        if self.diag is not None:
            initial, final = self.diag
            metrics.update(final)
            self.summary.attn_init = initial
        metrics.update(self.prune_metrics)
        self.summary.metrics = metrics
        best = self.folder.checkpoint("best")
        self.summary.best_checkpoint = self.folder.relative(best) if best.exists() else None
        self._end_summary("ok", None)
        if self.writer:
            self.folder.write_summary(self.summary)
            if self.cfg.results_table:
                self.log.table(results_table(self.summary), results_line(self.summary))
            self.log.info(f"run folder: {shown(self.folder.path)}")
        if self.multirun:
            self._record_job("ok", None)
        return float(metrics.get(self.cfg.optimized_metric, float("nan")))

    # ============================================================================ endings other than ok

    def refuse(self, exc: BaseException, code: int = 2) -> float:
        """Nothing was started: an existing run's files are as they were."""
        reason = _one_line(exc)
        if isinstance(exc, RunFolderBusy):
            pass  # the folder is another process's: leave every file of it alone
        elif self.multirun and self.writer and not self.folder.holds_run():
            # a job of a sweep: recorded as failed in its own new folder, and the sweep goes on
            self.summary = Summary(status="failed", reason=reason, overrides=self.overrides)
            self._settings()
            self.folder.write_summary(self.summary)
        else:
            self._remove_created_dirs()
        return self._end("failed", reason, code=code, exc=exc)

    def fail(self, exc: BaseException) -> float:
        from attnlab.training.loggers import finish_wandb

        if not self.started:  # broke while preparing: as a refusal, nothing of an existing run is touched
            return self.refuse(exc, code=1)
        finish_wandb(failed=True)
        reason = _one_line(exc)
        self._end_summary("failed", reason)
        if self.writer:
            self.folder.write_summary(self.summary)
        return self._end("failed", reason, code=1, exc=exc)

    def interrupted(self, exc: BaseException) -> float:
        """Ctrl-C (SIGINT) or SIGTERM: ``status: interrupted`` and the resume command; a multirun stops."""
        from attnlab.training.loggers import finish_wandb

        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores SIGINT after the first
        if not self.started:
            self._remove_created_dirs()
            self.log.error("interrupted before the run started; nothing was written")
        else:
            finish_wandb(failed=True)
            self._end_summary("interrupted", None)
            reason = f"interrupted at step {self.summary.steps}"
            self.summary.reason = self.segment.reason = reason
            if self.writer:
                self.folder.write_summary(self.summary)
                resume = f"python train.py resume=true hydra.run.dir={shown(self.folder.path)}"
                self.log.info(f"{reason}; resume with: {resume}")
            if self.multirun:
                self._record_job("interrupted", reason)
        if self.multirun or self.in_process or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise KeyboardInterrupt from exc  # in a multirun, Ctrl-C stops the whole sweep
        raise SystemExit(130)

    def _end(self, status: str, reason: str, code: int, exc: BaseException) -> float:
        self.log.error(reason)
        if self.multirun:
            self._record_job(status, reason)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise exc
        if self.multirun or self.in_process:
            return _failed_value()
        raise SystemExit(code) from None

    # ============================================================================ helpers

    def _read(self, reader: Any) -> Any:
        try:
            return reader()
        except RunFileError as exc:
            raise ConfigError(f"cannot use the run in {self.folder.path}: {exc}") from None

    def _stored_max_steps(self) -> int | None:
        try:
            return int(self.folder.read_config()["max_steps"])
        except (RunFileError, KeyError, TypeError, ValueError):
            return None

    def _check_launch(self) -> None:
        """Refuse a multi-process trainer that Lightning would start by re-running the command line inside a
        ``-m`` sweep: every extra process would start the whole sweep again."""
        from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

        launcher = getattr(self.trainer.strategy, "launcher", None)
        if (
            self.multirun
            and isinstance(launcher, _SubprocessScriptLauncher)
            and not launcher.cluster_environment.creates_processes_externally
            and launcher.num_processes > 1
        ):
            raise ConfigError(
                f"a {type(self.trainer.strategy).__name__} trainer with {launcher.num_processes} devices cannot run "
                "in a -m sweep (Lightning starts the other processes by re-running the command line); run it as a "
                "single run, or sweep with hydra/launcher=slurm and hydra.launcher.tasks_per_node=<devices>"
            )

    def _compile(self) -> None:
        """``compile=true``: compile the module's training step in place, with one trial step on a training batch
        (the random state and the gradients stay as they were, the trainer's precision is on), and say so in one
        line. Where torch.compile cannot run on the trainer's device, or fails on this model, or the trainer spawns
        its processes (``ddp_spawn`` pickles the model, and the compiled forward with it would be lost), the run
        trains eagerly after one warning line. The segment records which it was (``compiled``); a resume that trains
        otherwise than the run's earlier parts says so in a warning line (its numbers mix the two)."""
        if not self.cfg.get("compile", False):
            return
        if self.ckpt is not None and int(self.ckpt["global_step"]) >= self.cfg.max_steps:
            return  # nothing left to train (killed during its test): validation and test run eagerly anyway
        from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

        from attnlab.module import compile_problem, deterministic_flags

        device = self.trainer.strategy.root_device
        if isinstance(getattr(self.trainer.strategy, "launcher", None), _MultiProcessingLauncher):
            problem: str | None = "a spawning trainer pickles the model for its processes, without the compiled forward"
        else:
            problem = compile_problem(device)
        started = time.perf_counter()
        if problem is None:
            # same seed, same numbers (on CPU, as eager runs): torch's deterministic algorithms for this run
            self.deterministic_before = deterministic_flags()
            tokens, labels = self.datamodule.tensors("train")
            batch = self.datamodule.batch_size
            example = (tokens[:batch].clone().to(device), labels[:batch].clone().to(device))
            problem = self.module.to(device).compile_forward(
                example, deterministic=device.type == "cpu", context=self.trainer.precision_plugin.train_step_context
            )
        if problem is not None:  # (compile_forward has put torch's flags back)
            self.log.info(f"warning: compile=true, but torch.compile fails here ({problem}); training eagerly")
        else:
            self.log.info(
                f"compile=true: training steps run under torch.compile (inductor), compiled in "
                f"{time.perf_counter() - started:.1f} s (an epoch's shorter last batch compiles when it comes); "
                "validation and test run eagerly"
            )
        compiled = problem is None
        if self.segment is not None:
            self.segment.compiled = compiled
        earlier = {seg.compiled for seg in self.summary.segments if seg is not self.segment} - {None}
        if earlier - {compiled}:
            self.log.info(
                f"warning: this part of the run trains {'compiled' if compiled else 'eagerly'}, its earlier part "
                f"{'eagerly' if compiled else 'compiled'}: its numbers mix the two (compiled numbers are not eager "
                "numbers)"
            )

    def _restore_deterministic(self) -> None:
        """torch's deterministic algorithms as they were before compile=true turned them on for this run."""
        if self.deterministic_before is not None:
            from attnlab.module import set_deterministic_flags

            set_deterministic_flags(self.deterministic_before)
            self.deterministic_before = None

    def _truncate_metrics(self) -> None:
        """A new run starts metrics.jsonl anew; a resumed one cuts it back to its checkpoint's row count (never
        below the rows of a finished part that an extension keeps)."""
        jsonl = self.loggers[0]
        if self.kind == "new":
            jsonl.truncate(0)
        else:
            rows = (self.ckpt or {}).get("callbacks", {}).get("RunState", {}).get("metrics_rows", 0)
            jsonl.truncate(max(int(rows), self.rows_floor))

    def _settings(self) -> None:
        """The key settings into the summary; also for a config that failed validation (an unset value, or one of
        another type than the summary's field, is stored as null: a reader checks every field's type)."""
        from omegaconf import OmegaConf

        def get(key: str) -> Any:
            try:
                return plain(OmegaConf.select(self.cfg, key, throw_on_missing=True))
            except Exception:
                return None

        s = self.summary
        s.variant, s.mask, s.task = get("variant.name"), get("mask.name"), get("task.name")
        s.model = _model_name(self.cfg)
        s.num_heads, s.d_model, s.num_layers, s.seed = get("num_heads"), get("d_model"), get("num_layers"), get("seed")
        s.lr, s.batch_size, s.max_steps = get("lr"), get("batch_size"), get("max_steps")
        s.max_tokens = get("max_tokens")
        s.pos_encoding, s.variant_params = get("model.pos_encoding"), get("variant.params") or {}
        self._attention_settings()
        try:
            s.d_k = resolve_d_k(self.cfg)
        except Exception:
            s.d_k = get("d_k")
        s.smoke = bool(get("smoke"))
        s.launch_id = os.environ.get("ATTNLAB_UID")
        s.clear_mistyped()

    def _attention_settings(self) -> None:
        """The layers' attention into the summary, from their :class:`~attnlab.config.AttentionConfig`: layer 1's
        fields, the configured attention's one-line description, the pattern and each layer's changes."""
        from attnlab.config import pattern_name

        s = self.summary
        try:
            configs = attention_configs(self.cfg)
        except Exception:  # a config that failed validation: its summary keeps what could be read
            return
        s.settings = configs[0].resolved().to_dict() if configs else {}
        s.attention = base_attention(self.cfg).describe()
        s.pattern = pattern_name(configs, self.cfg.model.get("pattern"))
        s.layers = [c.changes() for c in configs] if s.pattern else []

    def _begin_summary(self, step: int) -> None:
        import torch

        s = self.summary
        for seg in s.segments:  # a segment still "running" belongs to a process that was killed
            if seg.status == "running":
                seg.status, seg.reason = "interrupted", "the process ended without finishing (killed?)"
        self._settings()
        if not s.overrides:
            s.overrides = self.overrides
        s.metrics_rows_floor = max(s.metrics_rows_floor, self.rows_floor)  # an extension keeps the rows so far
        s.status, s.reason = "running", None
        s.params = self.module.num_parameters
        s.chance_accuracy = getattr(self.module, "chance_accuracy", None)
        s.headline_metric = self._headline_metric()
        s.threads, s.torch = self.threads, torch.__version__
        s.device, s.world_size = str(self.trainer.strategy.root_device), self.trainer.world_size
        s.backends = self._backends()
        length = self.module.hparams.get("max_len") or 0
        s.state_size = [layer.self_attn.state_size(length) for layer in self.module.encoder.layers]
        self._compute_summary()
        s.wandb_id = self.wandb_id if self.cfg.logger.name == "wandb" else None
        if self.ckpt_path is not None:
            s.resumed_from, s.resumed_at_step = self.folder.relative(self.ckpt_path), step
        self.segment = Segment(self.kind, utc_now(), step, self.overrides, target_steps=self.cfg.max_steps)
        s.segments.append(self.segment)

    def _compute_summary(self) -> None:
        """Parameters without embeddings, FLOPs per token of a training step, tokens per step, and what ``match``
        sized, into the summary (:mod:`attnlab.compute`). Only the folder's writer counts the FLOPs: a copy of the
        model runs one step on random tokens, leaving the model and the random numbers of training untouched. A
        count that fails is left null, with one warning line: the run goes on."""
        from attnlab.compute import non_embedding_params, step_flops, tokens_per_step

        s, dm = self.summary, self.datamodule
        s.params_non_embedding = non_embedding_params(self.module)
        accumulate = int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1)
        s.tokens_per_step = tokens_per_step(dm.batch_size, dm.seq_len, self.trainer.world_size, accumulate)
        if self.matched is not None:
            count = s.params if self.matched["by"] == "params" else sum(s.state_size)
            s.matched = {**self.matched, "achieved": count}
        if not self.writer:
            return
        try:
            flops = step_flops(
                self.module,
                dm.batch_size,
                dm.seq_len,
                device=self.trainer.strategy.root_device,
                context=self.trainer.precision_plugin.train_step_context,
            )
        except Exception as exc:  # counting is a report: it never stops a run
            s.flops_per_token = None
            self.log.info(f"warning: the FLOPs of a training step could not be counted ({_one_line(exc)})")
        else:
            s.flops_per_token = flops / (dm.batch_size * dm.seq_len)

    def _end_summary(self, status: str, reason: str | None) -> None:
        s, seg = self.summary, self.segment
        s.status, s.reason = status, reason
        if self.trainer is not None:  # (before Lightning restores a checkpoint its step reads 0)
            s.steps = max(self.trainer.global_step, seg.from_step if seg is not None else 0)
            if status != "ok":
                s.metrics = {**s.metrics, **self._callback_metrics()}
            if s.tokens_per_step is not None:
                s.tokens_seen = s.steps * s.tokens_per_step
        if self.timer is not None and self.timer.median() is not None:  # (a start that trained no step keeps
            s.step_time_s = self.timer.median()  # the earlier value)
        if seg is not None:
            seg.status, seg.reason, seg.to_step = status, reason, s.steps
            seg.wall_time_s = time.perf_counter() - self.started_at
            seg.results = {k: s.metrics[k] for k in ("val/acc_best", "test/acc") if s.metrics.get(k) is not None}
        s.wall_time_s = sum(x.wall_time_s for x in s.segments if x.wall_time_s is not None)

    def _callback_metrics(self) -> dict[str, float]:
        if self.trainer is None:
            return {}
        return {k: float(v) for k, v in self.trainer.callback_metrics.items() if v.numel() == 1}

    def _headline_metric(self) -> str | None:
        """The task's headline metric for this run (:meth:`~attnlab.tasks.SequenceTask.headline_metric`, with the
        run's ``task.datamodule`` options); None for a task that declares none."""
        headline = getattr(self.datamodule, "headline_metric", None)
        if not callable(headline):
            return None
        try:
            return headline(self.datamodule.test_lengths, **_task_options(self.cfg))
        except Exception:  # (a declaration that fails on its options: without them, as the dashboard falls back)
            return headline(self.datamodule.test_lengths)

    def _backends(self) -> list[str]:
        """The backend of each layer's training step on the trainer's device and precision."""
        from attnlab.backends import precision_dtype

        dtype = precision_dtype(self.trainer.precision)
        device = self.trainer.strategy.root_device
        try:
            return [layer.self_attn.backend_for(device, dtype) for layer in self.module.encoder.layers]
        except RuntimeError as exc:  # a forced backend that cannot run here: the first step says so too
            raise ConfigError(" ".join(str(exc).split())) from None

    def _start_line(self, step: int) -> str:
        cfg, s = self.cfg, self.summary
        what = {"new": "new run", "resume": f"resumed at step {step}", "extend": f"extended from step {step}"}
        backends = sorted(set(s.backends))
        backend = backends[0] if len(backends) == 1 else "/".join(s.backends)
        layers = f"pattern {s.pattern} · " if s.pattern else ""
        parts = [
            f"run {shown(self.folder.path)} ({what[self.kind]})",
            f"{s.attention or s.variant} · {layers}{s.task}",
            f"d_model {s.d_model}, {_n(s.num_heads, 'head')} × d_k {s.d_k}, {_n(s.num_layers, 'layer')}, "
            f"{s.params:,} params, backend {backend}, state {sum(s.state_size):,} floats/seq",
            f"{cfg.max_steps} steps of batch {cfg.batch_size}{self._budget_text()}, lr {cfg.lr:g}, seed {cfg.seed}",
            f"{s.device}" + (f", {_n(s.threads, 'thread')}" if s.device == "cpu" else ""),
        ]
        if s.smoke:
            parts.append("smoke run (debug=fast)")
        return " · ".join(parts)

    def _budget_text(self) -> str:
        """`` (1.2M tokens, max_tokens 1M; 3.4M FLOPs/token; model.d_ff 300 matched to 25,000 params)`` for the
        start line: what the run will train on and cost, and what its budgets set."""
        from attnlab.training.console import compact

        s, parts = self.summary, []
        if s.tokens_per_step is not None:
            tokens = f"{compact(self.cfg.max_steps * s.tokens_per_step)} tokens"
            parts.append(tokens + (f", max_tokens {compact(s.max_tokens)}" if s.max_tokens is not None else ""))
        if s.flops_per_token is not None:
            parts.append(f"{compact(s.flops_per_token)} FLOPs/token")
        if s.matched is not None:
            m = s.matched
            aim = f"variant={m['reference']}'s {m['target']:,}" if m.get("reference") else f"{m['target']:,}"
            parts.append(f"{m['width']} {m['value']} matched to {aim} {m['by']} ({m['achieved']:,})")
        return f" ({'; '.join(parts)})" if parts else ""

    def _record_job(self, status: str, reason: str | None) -> None:
        if not self.writer:
            return
        from attnlab.training.multirun import job_done

        sweep = Path(_hydra().sweep.dir)
        try:
            job = self.folder.path.resolve().relative_to(sweep.resolve()).as_posix()
        except ValueError:
            job = self.folder.path.name
        job_done(job, status, reason, time.perf_counter() - self.started_at)

    def _remove_created_dirs(self) -> None:
        """Remove the folders made for a run that did not start (only those made for it, and only if empty apart
        from the lock this process left)."""
        if not self.writer:
            return
        for path in self.created:
            for leftover in (".attnlab.lock", ".attnlab.lock.json"):
                (path / leftover).unlink(missing_ok=True)
            try:
                path.rmdir()
            except OSError:
                return


def _from_signal(exc: BaseException) -> bool:
    """Whether an error is Ctrl-C or SIGTERM in disguise: raised while handling (or because of) a KeyboardInterrupt
    or SystemExit, or after the signal arrived (``train.py``'s handler notes it). A signal that lands inside
    ``torch.save`` ends its zip writer half-way, whose closing then raises a RuntimeError: that run was interrupted,
    not failed, and resumes from its last complete checkpoint."""
    from attnlab.training.multirun import signalled

    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:  # (the causes and the contexts)
        cause = todo.pop()
        if id(cause) in seen:
            continue
        if isinstance(cause, (KeyboardInterrupt, SystemExit)):
            return True
        seen.add(id(cause))
        todo.extend(c for c in (cause.__cause__, cause.__context__) if c is not None)
    return signalled()
