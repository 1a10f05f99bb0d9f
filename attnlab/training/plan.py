"""A run's or a sweep's plan and cost before it runs: ``python train.py ... --dry-run`` (single runs, ``-m`` sweeps
and ``hydra/sweeper=tuned``) and ``python -m attnlab.card --dry-run``.

The plan is every job the command would run, in Hydra's order and numbering (the basic sweeper's product of the
swept values; the tuned sweeper's grid on ``tune_seed``, then the seeds at each configuration's chosen point, which
is not known before the grid has run: its cost is the grid points' mean), each with the keys that vary between jobs
(never cut), its steps, tokens and FLOPs per training step (:func:`attnlab.compute.step_flops`, the number a run
records), and an estimate of its wall time. Nothing is written in a run or sweep folder; the only file touched is the
step-time cache (below).

**The estimate** (seconds of one job, on this machine, one process):

    steps · t_step  +  evaluations · (val batches + 1) · t_eval  +  test batches · t_eval  +  head step  +  t_job

* ``t_step``, one training step (forward, backward, AdamW) of the job's model at its batch shape, is *timed*: a
  warm-up step and then :data:`TIMED_STEPS` steps on random tokens, once per distinct model (jobs that differ
  only in learning rate, seed, weight decay or steps share it). A job's FLOPs per step do not predict its time on
  a CPU well enough on their own (the additive score's step is several times slower per FLOP than SDPA's), so the
  FLOP count is reported beside the time, and the timing is what the estimate uses. The timings are cached in
  ``$XDG_CACHE_HOME/attnlab/step_times.json`` (``~/.cache/...``), keyed by the model's settings, the batch shape,
  the torch version, the thread count and the processor, so that a second ``--dry-run`` and the sweep itself
  (which estimates its jobs when it starts, for its "left" line and its closing report) time nothing again.
* ``t_eval``, a forward pass, is ``t_step`` × :data:`EVAL_FRACTION` (the forward is about a third of a step).
* ``evaluations``: one every ``eval_every`` steps and one at the start (the step-0 diagnostics' probe); the
  validation batches are ``trainer.limit_val_batches`` or the whole validation set, the test's likewise.
* the head step (``diagnostics.importance``; off by default in sweeps and smoke runs): a backward over the validation
  batches for the importance, then ``(1 + heads) · (1 + random_orders)`` passes over the test set (the pruning
  curves' points), at ``t_eval`` per batch.
* ``t_job`` (:data:`JOB_OVERHEAD_S`): what a job costs besides its steps: building the data, the FLOP count, the
  diagnostics' probes and plots, checkpoints, the folder's files. And once per command, :data:`START_S` for Python's
  imports.

Measured against the truth on this project's 2-core machine (docs/getting-started.md gives the numbers): the
README's 6-run sweep and a tuned MQAR sweep; a sweep's closing report prints estimated against actual minutes
(:mod:`attnlab.training.multirun`), so every sweep checks it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnlab.training.multirun import head_step_on

__all__ = [
    "EVAL_FRACTION",
    "JOB_OVERHEAD_S",
    "START_S",
    "TIMED_STEPS",
    "Job",
    "Plan",
    "estimate_job",
    "plan_command",
    "print_plan",
    "step_time",
]

TIMED_STEPS = 3
"""Training steps timed per distinct model, after one warm-up step (fewer when one step takes over 2 s)."""
EVAL_FRACTION = 0.35
"""A forward pass (evaluation) as a fraction of a training step."""
JOB_OVERHEAD_S = 2.5
"""Seconds a job costs besides its steps and evaluations (data, FLOP count, probes, plots, checkpoints, files)."""
START_S = 4.0
"""Seconds of Python's imports, once per command."""

_TIME_INDEPENDENT = ("seed", "lr", "model.weight_decay", "max_steps", "max_tokens", "overwrite", "resume")


@dataclass
class Job:
    """One job of a plan."""

    number: int
    """Hydra's job number (the folder's leading number; a tuned sweep numbers its grid then its seeds)."""
    overrides: list[str]
    """The job's overrides (those of the command line and the sweeper's)."""
    stage: str = "run"
    """``run`` (a single run or a basic sweep's job), ``tune`` or ``seeds`` (a tuned sweep's stages)."""
    label: str = ""
    """The keys that vary between the plan's jobs, as ``key=value`` joined by spaces."""
    steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    flops_per_step: int | None = None
    step_s: float | None = None
    """One training step's seconds, timed (or from the cache)."""
    seconds: float | None = None
    """The estimated wall time of the job."""
    error: str | None = None
    """Why the job would be refused (one line), instead of an estimate."""
    note: str = ""
    """What the estimate assumed (a tuned sweep's seed job: the grid's mean)."""

    @property
    def tokens(self) -> int | None:
        if None in (self.steps, self.batch_size, self.seq_len):
            return None
        return int(self.steps) * int(self.batch_size) * int(self.seq_len)


@dataclass
class Plan:
    """The jobs of a command and what they cost."""

    kind: str
    """``run``, ``sweep`` (the basic sweeper), ``tuned`` or ``optuna``."""
    jobs: list[Job] = field(default_factory=list)
    tuned: dict[str, Any] | None = None
    """A tuned sweep's grid, tune_seed, seeds, metric and configurations."""
    timed_models: int = 0
    cached_models: int = 0
    timing_s: float = 0.0
    threads: int = 1
    """Torch threads a job runs with (``threads``, ``$OMP_NUM_THREADS``, or the cores shared among the jobs run at
    once, as :func:`attnlab.training.config.set_threads` decides): its steps are timed with as many."""
    parallel: int = 1
    """Jobs run at once (joblib's ``n_jobs``; 1 for the basic launcher)."""
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """The whole command: Python's start, then the jobs, ``parallel`` at a time (their sum divided: the
        estimate of a machine whose cores the jobs share evenly)."""
        return START_S + sum(j.seconds or 0.0 for j in self.jobs) / max(1, self.parallel)

    def estimates(self) -> dict[str, float]:
        """``{job number: seconds}`` (as strings: the sweep journal is JSON)."""
        return {str(j.number): float(j.seconds) for j in self.jobs if j.seconds is not None}


# ------------------------------------------------------------------------------------------------ planning


def _compose(overrides: Sequence[str], hydra_config: bool = False) -> DictConfig:
    """The config of ``overrides`` as a job would get it (inside a running Hydra app, through its own loader)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from attnlab.training.config import CONF_DIR

    if GlobalHydra.instance().is_initialized():  # (a sweep's start: Hydra's app is running)
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_config)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_config)


def _split_jobs(arguments: Sequence[str]) -> list[list[str]]:
    """The basic sweeper's jobs: the product of the swept values, in its order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(arguments))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _varying_labels(jobs: list[Job]) -> None:
    """Each job's label: the ``key=value`` pairs that are not the same in every job (all of them when one job)."""
    from attnlab.training.multirun import varying_keys

    pairs = [dict(o.split("=", 1) for o in job.overrides if "=" in o) for job in jobs]
    varying = varying_keys(pairs)
    for job, p in zip(jobs, pairs, strict=True):
        job.label = " ".join(f"{k}={p[k]}" for k in varying if k in p) or "(the defaults)"


def plan_command(argv: Sequence[str], fresh: bool = True, log: Callable[[str], None] | None = None) -> Plan:
    """The plan of ``python train.py <argv>`` (``-m`` for a sweep), with each job's cost. ``fresh``: time every
    distinct model now (a dry run: the machine as it is now); else take the cached step times and time only the
    models the cache lacks (a sweep's start)."""
    from attnlab.training.config import ConfigError

    args = [a for a in argv if a not in ("-m", "--multirun", "--dry-run")]
    multirun = len(args) != len(argv) - ("--dry-run" in argv)
    hydra_args = [a for a in args if a.split("=", 1)[0].lstrip("+~").startswith("hydra")]
    task_args = [a for a in args if a not in hydra_args]
    if not multirun:
        plan = Plan("run", [Job(0, task_args)])
    else:
        try:
            root = _compose(hydra_args + [_first(a) for a in task_args], hydra_config=True)
        except Exception as exc:  # (Hydra's own errors are several lines)
            raise ConfigError(f"the sweep cannot be planned: {' '.join(str(exc).split())}") from None
        check_sweep_config(args)
        target = str(OmegaConf.select(root, "hydra.sweeper._target_") or "")
        if target.endswith("TunedSweeper"):
            plan = _tuned_plan(root, task_args)
        elif "optuna" in target.lower():
            trials = int(OmegaConf.select(root, "hydra.sweeper.n_trials") or 0)
            base = [_first(a) for a in task_args]
            plan = Plan("optuna", [Job(n, base, note="a trial: its point is Optuna's choice") for n in range(trials)])
            plan.notes.append(f"Optuna: {trials} trials, each estimated at the command line's first values")
        else:
            params = [f"{k}={v}" for k, v in (OmegaConf.select(root, "hydra.sweeper.params") or {}).items()]
            try:
                jobs = _split_jobs([*params, *task_args])
            except Exception as exc:
                raise ConfigError(f"the sweep cannot be planned: {' '.join(str(exc).split())}") from None
            plan = Plan("sweep", [Job(n, list(o)) for n, o in enumerate(jobs)])
    if multirun:
        plan.parallel = _parallel(root)
    plan.threads = _threads(task_args, plan.parallel)
    _varying_labels(plan.jobs)
    if plan.tuned is not None:  # a seed job's grid keys: the chosen point, not known before the grid has run
        for job in plan.jobs:
            if job.stage == "seeds":
                job.label = " ".join(
                    f"{k}=(chosen)" if (k := part.split("=", 1)[0]) in plan.tuned["grid"] else part
                    for part in job.label.split(" ")
                )
    _cost(plan, fresh, log or (lambda _: None))
    return plan


def _parallel(root: DictConfig) -> int:
    """The jobs a multirun's launcher runs at once: joblib's ``n_jobs`` (-1: every core), else 1."""
    launcher = OmegaConf.select(root, "hydra.launcher") or {}
    if "joblib" not in str(launcher.get("_target_", "")).lower():
        return 1
    n_jobs = int(launcher.get("n_jobs", -1) or -1)
    return (os.cpu_count() or 1) if n_jobs < 0 else max(1, n_jobs)


def _threads(task_args: Sequence[str], parallel: int) -> int:
    """The threads a job will run with (:func:`attnlab.training.config.set_threads`'s rule)."""
    given = [a.split("=", 1)[1] for a in task_args if a.split("=", 1)[0].lstrip("+~") == "threads"]
    if given and given[-1].isdigit():
        return int(given[-1])
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // max(1, parallel))


def check_sweep_config(args: Sequence[str]) -> None:
    """Refuse in one line (:class:`~attnlab.training.config.ConfigError`), before Hydra does in several, a sweep whose
    fixed overrides do not compose without its swept ones: Hydra builds the sweep's own config from the overrides
    that are not swept, with every swept group at its default, so ``variant=deltanet,gated_deltanet
    variant.params.beta_range=2`` fails (the default variant has no ``beta_range``) although each of its jobs
    composes. ``args``: a multirun's overrides (``-m`` and ``--dry-run`` left out)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from attnlab.training.config import ConfigError

    hydra_args = [a for a in args if a.split("=", 1)[0].lstrip("+~").startswith("hydra")]
    task_args = [a for a in args if a not in hydra_args]
    try:
        parsed = OverridesParser.create().parse_overrides(list(task_args))
    except Exception:  # (reported with the jobs)
        return
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    swept = [o.input_line for o in parsed if o.is_sweep_override()]
    if not swept:
        return
    try:
        _compose([*hydra_args, *fixed])
    except Exception as exc:
        raise ConfigError(
            f"the sweep cannot start: Hydra composes its config from the overrides that are not swept, with "
            f"{', '.join(swept)} at their defaults, and that fails: {' '.join(str(exc).split())}; run one sweep per "
            f"value of the swept group (or sweep the fixed key too)"
        ) from None


def _first(arg: str) -> str:
    """A swept override's first value (``d_k=8,512`` → ``d_k=8``; ``x=range(1,3)`` is left to Hydra)."""
    key, sep, value = arg.partition("=")
    if not sep or value.startswith(("[", "{", "'", '"')) or "(" in value:
        return arg
    return f"{key}={value.split(',')[0]}"


def _tuned_plan(root: DictConfig, task_args: list[str]) -> Plan:
    from attnlab.training.config import ConfigError
    from attnlab.training.tuned import TunedError, TunedSweeper, _text, grid_points

    settings = {k: v for k, v in OmegaConf.to_container(root.hydra.sweeper).items() if k != "_target_"}
    try:
        sweeper = TunedSweeper(**settings)
        sweeper.config = root
        sweeper.validate()  # (the grid as the sweeper reads it: one given whole replaces the default)
        configs = sweeper._configurations(task_args)
        points = grid_points(sweeper.grid)
    except (TunedError, TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    metric = sweeper.metric or str(root.get("optimized_metric") or "val/acc_best")
    plan = Plan("tuned")
    plan.tuned = {
        "grid": sweeper.grid,
        "points": len(points),
        "tune_seed": sweeper.tune_seed,
        "seeds": list(sweeper.seeds),
        "metric": metric,
        "direction": sweeper.direction,
        "configurations": [sweeper._label(o) or "(base)" for o in configs],
    }
    num = 0
    for overrides in configs:
        for point in points:
            grid = [f"{k}={_text(v)}" for k, v in point.items()]
            plan.jobs.append(Job(num, [*overrides, *grid, f"seed={sweeper.tune_seed}"], stage="tune"))
            num += 1
    for i, overrides in enumerate(configs):
        for seed in sweeper.seeds:
            if seed == sweeper.tune_seed:
                continue
            first = [f"{k}={_text(v)}" for k, v in points[0].items()]
            job = Job(num, [*overrides, *first, f"seed={seed}"], stage="seeds")
            job.note = f"configuration {i}: at its chosen point (the grid's mean cost)"
            plan.jobs.append(job)
            num += 1
    return plan


# ------------------------------------------------------------------------------------------------- costing


def _cost(plan: Plan, fresh: bool, log: Callable[[str], None]) -> None:
    """Compose and check each job's config, count its FLOPs, time (or look up) its model's step, estimate it."""
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(plan.threads)  # (the jobs' own count: timed as they will run, keyed by it in the cache)
    try:
        _cost_jobs(plan, fresh, log)
    finally:
        torch.set_num_threads(threads_before)


def _cost_jobs(plan: Plan, fresh: bool, log: Callable[[str], None]) -> None:
    from attnlab.training.config import ConfigError

    cache = _Cache.load()
    models: dict[str, tuple[float | None, Any]] = {}
    started = time.perf_counter()
    for job in plan.jobs:
        try:
            cfg, datamodule, module = _build(job.overrides)
        except ConfigError as exc:
            job.error = str(exc)
            continue
        except Exception as exc:  # a job the sweep would see fail: say so, plan the others
            job.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
            continue
        job.steps, job.batch_size, job.seq_len = int(cfg.max_steps), datamodule.batch_size, datamodule.seq_len
        key = _model_key(job.overrides, datamodule)
        if key not in models:
            step_s = None if fresh else cache.get(key)
            if step_s is None:
                log(f"timing model {len(models) + 1}: {job.label} ...")
                step_s = step_time(module, datamodule.batch_size, datamodule.seq_len)
                cache.put(key, step_s)
                plan.timed_models += 1
            else:
                plan.cached_models += 1
            flops = _flops(module, datamodule)
            models[key] = (step_s, flops)
        job.step_s, job.flops_per_step = models[key]
        if job.step_s is not None:
            job.seconds = estimate_job(cfg, datamodule, job.step_s, plan.kind != "run")
    plan.timing_s = time.perf_counter() - started
    if plan.kind == "tuned":  # a seed job's chosen point is unknown: the mean of its configuration's grid
        tune = [j for j in plan.jobs if j.stage == "tune"]
        per_config = len(tune) // max(1, len(plan.tuned["configurations"]))
        for job in (j for j in plan.jobs if j.stage == "seeds"):
            i = int(job.note.split()[1].rstrip(":"))
            grid = [j.seconds for j in tune[i * per_config : (i + 1) * per_config] if j.seconds is not None]
            if grid and job.error is None:
                job.seconds = sum(grid) / len(grid)
    cache.save()


def _build(overrides: Sequence[str]) -> tuple[DictConfig, Any, Any]:
    """A job's config, checked as the run checks it before writing anything (:class:`ConfigError` in one line),
    its datamodule and its model."""
    from attnlab.training.config import (
        build_module,
        check_resolves,
        import_user_modules,
        resolve_match,
        validate_config,
    )

    cfg = _compose(overrides)
    check_resolves(cfg)
    import_user_modules(cfg)
    with _quiet():
        datamodule = validate_config(cfg)
        if resolve_match(cfg, datamodule) is not None:
            datamodule = validate_config(cfg)
        module = build_module(cfg, datamodule)
    return cfg, datamodule, module


@contextlib.contextmanager
def _quiet() -> Any:
    import logging
    import warnings

    level = logging.getLogger("attnlab").level
    logging.getLogger("attnlab").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.getLogger("attnlab").setLevel(level)


def _model_key(overrides: Sequence[str], datamodule: Any) -> str:
    """What a step's time depends on: the job's overrides but those of :data:`_TIME_INDEPENDENT` (the rest of the
    config is conf/'s, the same for every job of a version), attnlab's version, the batch shape, and the machine
    (processor, threads, torch)."""
    import torch

    import attnlab

    kept = sorted(
        o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in _TIME_INDEPENDENT and not o.startswith("hydra")
    )
    machine = [_processor(), torch.get_num_threads(), torch.__version__, datamodule.batch_size, datamodule.seq_len]
    text = json.dumps([kept, attnlab.__version__, machine], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _processor() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def step_time(module: Any, batch_size: int, seq_len: int, steps: int = TIMED_STEPS) -> float:
    """Seconds of one training step (the module's loss on random tokens of the task's shape, its backward, an AdamW
    update) on a copy of ``module``, on the CPU: the median of ``steps`` timed steps after one warm-up (one timed
    step when the warm-up took over 2 s). The module and the random numbers of training are untouched."""
    import copy
    import statistics

    import torch

    hp = module.hparams
    with torch.random.fork_rng(devices=[]):
        twin = copy.deepcopy(module).train()
        optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-4)
        tokens = torch.randint(0, int(hp["vocab_size"]), (batch_size, seq_len))
        shape = (batch_size, seq_len) if hp["per_token"] else (batch_size,)
        labels = torch.randint(0, int(hp["num_classes"]), shape)

        def step() -> float:
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = twin._loss((tokens, labels))[0]
            loss.backward()
            optimizer.step()
            return time.perf_counter() - t0

        warm = step()
        times = [step() for _ in range(1 if warm > 2.0 else steps)]
    return statistics.median(times)


def _flops(module: Any, datamodule: Any) -> int | None:
    from attnlab.compute import step_flops

    try:
        with _quiet():
            return step_flops(module, datamodule.batch_size, datamodule.seq_len, device="cpu")
    except Exception:  # a count is a report
        return None


def _batches(cfg: DictConfig, datamodule: Any, split: str) -> int:
    """The batches of a validation (``val``) or test pass: the trainer's limit, or the whole split."""
    size = int(getattr(datamodule, f"num_{split}", 0) or 0)
    whole = max(1, math.ceil(size / max(1, datamodule.batch_size)))
    limit = OmegaConf.select(cfg, f"trainer.limit_{split}_batches")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
        return min(whole, limit)
    if isinstance(limit, float) and 0 < limit <= 1:
        return max(1, int(whole * limit))
    return whole


def estimate_job(cfg: DictConfig, datamodule: Any, step_s: float, multirun: bool) -> float:
    """The estimated seconds of one job (see the module docstring): its steps at ``step_s`` each, its evaluations,
    its test, its head step and :data:`JOB_OVERHEAD_S`."""
    steps = int(cfg.max_steps)
    eval_s = step_s * EVAL_FRACTION
    val, test = _batches(cfg, datamodule, "val"), _batches(cfg, datamodule, "test")
    evaluations = math.ceil(steps / max(1, int(cfg.eval_every))) + 1
    seconds = steps * step_s + evaluations * (val + 1) * eval_s + test * eval_s + JOB_OVERHEAD_S
    if head_step_on(cfg, multirun):
        heads = int(cfg.num_heads) * int(cfg.num_layers)
        orders = 1 + int(cfg.diagnostics.get("random_orders", 1) or 0)
        seconds += val * step_s + (1 + heads) * orders * test * eval_s
    return seconds


# ------------------------------------------------------------------------------------------------------ cache


class _Cache:
    """``{model key: seconds per step}`` in ``$XDG_CACHE_HOME/attnlab/step_times.json`` (``ATTNLAB_CACHE_DIR``
    overrides the folder; an unreadable file is an empty cache, and a cache that cannot be written is skipped)."""

    def __init__(self, path: Path, data: dict[str, float]) -> None:
        self.path, self.data, self.dirty = path, data, False

    @classmethod
    def load(cls) -> _Cache:
        root = os.environ.get("ATTNLAB_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attnlab"
        )
        path = Path(root) / "step_times.json"
        data: dict[str, float] = {}
        with contextlib.suppress(OSError, ValueError, RecursionError):
            if path.is_file() and not path.is_symlink() and path.stat().st_size < 4 * 2**20:
                raw = json.loads(path.read_text())
                if isinstance(raw, dict):
                    data = {
                        str(k): float(v)
                        for k, v in raw.items()
                        if isinstance(v, int | float) and math.isfinite(v) and v > 0
                    }
        return cls(path, data)

    def get(self, key: str) -> float | None:
        return self.data.get(key)

    def put(self, key: str, seconds: float) -> None:
        self.data[key], self.dirty = seconds, True

    def save(self) -> None:
        if not self.dirty:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(self.data, indent=0, sort_keys=True))
            os.replace(tmp, self.path)


# ---------------------------------------------------------------------------------------------------- output


def minutes(seconds: float | None) -> str:
    """``0:42`` / ``12:05`` / ``1:02:05`` for a duration; ``-`` for none."""
    from attnlab.training.console import clock

    return "-" if seconds is None else clock(seconds)


def print_plan(plan: Plan, command: str) -> None:
    """The plan as a table (every job, its varying keys never cut), then the totals and how they were estimated."""
    from rich.table import Table

    from attnlab.console import plain_console
    from attnlab.training.console import compact

    console = plain_console()
    kinds = {"run": "a single run", "sweep": "a sweep", "tuned": "a tuned sweep", "optuna": "an Optuna search"}
    console.print(f"dry run: {command} — {kinds[plan.kind]} of {len(plan.jobs)} job(s); nothing was run or written")
    if plan.tuned is not None:
        t = plan.tuned
        grid = ", ".join(f"{k}: {v}" for k, v in t["grid"].items())
        console.print(
            f"tuned: each of {len(t['configurations'])} configuration(s) runs the grid {{{grid}}} ({t['points']} "
            f"point(s)) on seed {t['tune_seed']}, picks the best {t['metric']} ({t['direction']}), then runs that "
            f"point on seeds {t['seeds']}"
        )
    table = Table(title=None, show_lines=False)
    table.add_column("job", justify="right", no_wrap=True)
    table.add_column("varying keys", justify="left", overflow="fold")
    if plan.kind == "tuned":
        table.add_column("stage", no_wrap=True)
    for col in ("steps", "tokens", "FLOPs/step", "s/step", "est. time"):
        table.add_column(col, justify="right", no_wrap=True)
    for job in plan.jobs:
        label = job.label
        if job.error:
            cells = [str(job.number), label, *(["refused"] if plan.kind == "tuned" else []), "-", "-", "-", "-", "-"]
            table.add_row(*cells)
            continue
        cells = [
            str(job.number),
            label,
            *([job.stage] if plan.kind == "tuned" else []),
            f"{job.steps:,}" if job.steps is not None else "-",
            compact(job.tokens) if job.tokens is not None else "-",
            compact(job.flops_per_step) if job.flops_per_step is not None else "-",
            f"{job.step_s:.3f}" if job.step_s is not None else "-",
            minutes(job.seconds),
        ]
        table.add_row(*cells)
    console.print(table)
    for job in plan.jobs:
        if job.error:
            console.print(f"  job {job.number} would be refused: {job.error}")
    estimated = [j for j in plan.jobs if j.seconds is not None]
    total = plan.seconds
    console.print(
        f"estimated: {minutes(total)} in all ({total / 60:.1f} min, {_at_once(plan.parallel)}; {len(estimated)} of "
        f"{len(plan.jobs)} jobs estimated), {plan.threads} thread(s) a job · step times: {plan.timed_models} model(s) "
        f"timed now, {plan.cached_models} from the cache ({plan.timing_s:.1f} s)"
    )
    for note in plan.notes:
        console.print(f"note: {note}")
    if any(j.error for j in plan.jobs):
        console.print("some jobs would be refused: the sweep runs the others and exits 1")


def _at_once(parallel: int) -> str:
    return "one job at a time" if parallel <= 1 else f"{parallel} jobs at a time"


def dry_run(argv: list[str]) -> int:
    """``python train.py ... --dry-run``: print the plan; exit code 0, or 2 when every job would be refused."""
    from attnlab.training.config import ConfigError

    command = "python train.py " + " ".join(a for a in argv if a != "--dry-run")
    try:
        plan = plan_command(argv, log=lambda m: print(m, file=sys.stderr, flush=True))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_plan(plan, command.strip())
    if plan.jobs and all(j.error for j in plan.jobs):
        if len(plan.jobs) == 1:
            print(f"error: {plan.jobs[0].error}", file=sys.stderr)
        return 2
    return 0
