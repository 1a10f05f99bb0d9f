"""A run's or a sweep's plan and cost before it runs: ``python train.py ... --dry-run`` (single runs, ``-m`` sweeps
and ``hydra/sweeper=tuned``) and ``python -m attnlab.card --dry-run``.

The plan is every job the command would run, in Hydra's order and numbering (the basic sweeper's product of the
swept values; the tuned sweeper's grid on ``tune_seed``, then the seeds at each configuration's chosen point, which
is not known before the grid has run: its cost is the grid points' mean), each with the keys that vary between jobs
(never cut), its steps, tokens and FLOPs per training step (:func:`attnlab.compute.step_flops`, the number a run
records), and an estimate of its wall time. Nothing is written in a run or sweep folder; the only file touched is the
step-time cache (below). The swept values are read by Hydra's own override parser and expanded as its sweeper
expands them: ``d_k=8,16``, ``d_k=range(8,65,8)``, ``lr=choice(1e-3,1e-2)``, ``variant=glob(*delta*)``.

**A large sweep is counted, not listed.** Composing and checking one job costs about a second, so a sweep of more
than :data:`FULL_PLAN_JOBS` jobs is not built job by job: its jobs are counted (the product of the swept keys'
values, never listed), and only representatives are composed, checked and timed. Jobs that differ only in
:data:`COST_FREE_KEYS` (seed, learning rate, weight decay) take the same time, so when the other swept keys make at
most :data:`MAX_SAMPLE_JOBS` distinct shapes, each shape is built once (with the cost-free keys' values spread over
up to :data:`SAMPLE_JOBS` representatives) and the total is exact: each shape's time × its jobs. Otherwise
:data:`SAMPLE_JOBS` to :data:`MAX_SAMPLE_JOBS` jobs are drawn as a Latin-hypercube sample (seed 0: every value of a
key with at most that many values is in one of them) and the total is their mean × the count. The plan says which,
and that the jobs not built were not checked.

**A run folder that already holds a run** (``hydra.run.dir=<folder>``, or a job's folder of ``hydra.sweep.dir``
given on the command line) is checked as the run checks it before it trains, by the same code and in the same
words (:meth:`attnlab.training.lifecycle.Run.inspect_folder`): a finished run without ``resume=true`` or
``overwrite=true`` is a job that would be refused, a folder another process holds is too, and a complete run asked
to resume is a job that would change nothing.

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

**Threads, and a busy machine.** Each job's torch threads are chosen as its run will choose them, by the one rule
of :mod:`attnlab.cores` (``threads=``, ``$OMP_NUM_THREADS``, a submitit job's ``cpus_per_task``, else the cores this
process may have less those other work keeps busy now, shared among the jobs run at once), from one measurement of
the machine made when the plan starts, and its steps are timed with as many (the cache is keyed by the count). The
plan prints that measurement (``machine: 2 core(s) for this process, 1.7 busy with other work now (load 3.9); jobs
will run with 1 thread(s) each``), and a ``note:`` when other work keeps more than half the cores busy (the load
alone makes the estimate long: wait, ``threads=1``, fewer jobs at once), when a job's given count is more than the
free cores, and when the load changed while the steps were timed (the machine is measured again after).

**Jobs that run elsewhere.** ``hydra/launcher=slurm`` is planned without ``srun``: the plan prints the launcher's
sbatch settings (its ``hydra.launcher`` node), and times each job here with its ``cpus_per_task`` threads, or with
the cores free here when those are fewer (and says so). A GPU trainer (``trainer=gpu``, ``gpu_bf16``,
``trainer.accelerator=gpu``) where torch sees no CUDA is checked as on a GPU
(:func:`~attnlab.training.config.validate.planned_elsewhere`: the run itself still refuses it) and built on the CPU:
its steps, tokens and FLOPs are counted, and its time is said to be unknown here.

**What differs between the jobs.** After the jobs are built, the settings that differ between them besides the
swept keys (each layer's built :class:`~attnlab.config.AttentionConfig` but the form's own ``score`` and
``score_params``, and every other config key) are printed in a ``note:`` (:func:`differing_settings`): a sweep over
forms whose presets set ``model.short_conv`` differently says so.

Measured against the truth on this project's 2-core machine (docs/getting-started.md gives the numbers): the
README's 6-run sweep and a tuned MQAR sweep; a sweep's closing report prints estimated against actual minutes
(:mod:`attnlab.training.multirun`), so every sweep checks it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnlab.cores import Machine, ThreadChoice, choose_threads, measure
from attnlab.training.multirun import head_step_on

__all__ = [
    "COST_FREE_KEYS",
    "EVAL_FRACTION",
    "FULL_PLAN_JOBS",
    "JOB_OVERHEAD_S",
    "MAX_SAMPLE_JOBS",
    "SAMPLE_JOBS",
    "START_S",
    "TIMED_STEPS",
    "Job",
    "Plan",
    "differing_settings",
    "estimate_job",
    "missing_plugin",
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
FULL_PLAN_JOBS = 64
"""A basic sweep of at most this many jobs is planned job by job (each composed, checked and timed); a larger one is
counted and planned from representatives (:data:`SAMPLE_JOBS`)."""
SAMPLE_JOBS = 8
"""The representative jobs of a sweep of more than :data:`FULL_PLAN_JOBS` jobs: at least this many (fewer when its
shapes are fewer and its cost-free keys have fewer values), and up to :data:`MAX_SAMPLE_JOBS` so that every value of
each swept key is in one of them."""
MAX_SAMPLE_JOBS = 12
COST_FREE_KEYS = ("seed", "lr", "model.weight_decay")
"""Keys that change neither the model, nor the data's shapes, nor the steps: jobs that differ only in them take the
same time (a large sweep builds one job per distinct value of the other keys)."""
MAX_VALUES = 10**6
"""The most values one swept key may list (a larger ``range()`` of integers is never listed, only counted)."""
MAX_ESTIMATES = 10_000
"""A counted sweep of at most this many jobs still gives every job an estimate (its shape's, or the mean) for the
sweep's "left" line; a larger one gives none."""


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
    weight: float = 1.0
    """How many of the command's jobs this one stands for (more than 1: a representative of a counted sweep)."""
    shape: tuple[int, ...] | None = None
    """A counted sweep's representative: its values' indices at the keys that are not :data:`COST_FREE_KEYS`."""
    threads: int | None = None
    """The torch threads the job runs with (:func:`attnlab.cores.choose_threads` on its own ``threads``)."""
    gpu: bool = False
    """A GPU job planned on a machine without CUDA: counted (steps, tokens, FLOPs), not timed."""
    accelerator: str | None = None
    """The job's ``trainer.accelerator`` (``auto``, ``cpu``, ``gpu`` ...)."""

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
    """Torch threads a job runs with (``threads``, ``$OMP_NUM_THREADS``, a submitit job's ``cpus_per_task``, or the
    free cores shared among the jobs run at once: :func:`attnlab.cores.choose_threads`, the rule
    :func:`attnlab.training.config.set_threads` runs with): its steps are timed with as many (a job that runs on
    another machine: with at most :attr:`timing_threads`). The first job's, when jobs differ (:attr:`Job.threads`)."""
    parallel: int = 1
    """Jobs run at once (joblib's ``n_jobs``; a SLURM array's ``array_parallelism``; 1 for the basic launcher)."""
    machine: Machine | None = field(default=None, repr=False)
    """This machine, measured once for the plan (:func:`attnlab.cores.measure`): its cores and how busy they are."""
    machine_after: Machine | None = field(default=None, repr=False)
    """This machine measured again after the steps were timed (None when none was timed now)."""
    choice: ThreadChoice | None = field(default=None, repr=False)
    """How the first job's threads were chosen (:attr:`threads`)."""
    cpus_per_task: int | None = None
    """A submitit launcher's ``cpus_per_task`` (each job's threads under ``threads=auto``)."""
    remote: str | None = None
    """``SLURM`` when the jobs run on a cluster (``hydra/launcher=slurm``), not here; None: on this machine."""
    launcher: dict[str, Any] | None = None
    """A remote launcher's settings (the ``hydra.launcher`` node: partition, timeout_min, cpus_per_task ...)."""
    timing_threads: int | None = None
    """The threads the steps were timed with here, when fewer than the jobs' own (a SLURM job's ``cpus_per_task``
    more than this machine has free); None: the jobs' own."""
    differing: dict[str, dict[str, str]] = field(default_factory=dict)
    """Settings that differ between the jobs besides the swept keys (:func:`differing_settings`)."""
    notes: list[str] = field(default_factory=list)
    count: int | None = None
    """The command's jobs when :attr:`jobs` holds only representatives of them (a counted sweep); else None."""
    space: _Space | None = field(default=None, repr=False)
    """A counted sweep's keys and values (its jobs by number, never listed)."""
    grouped: bool = False
    """A counted sweep whose every shape has a representative (:attr:`Job.shape`): its total is exact."""

    @property
    def total(self) -> int:
        """The jobs the command runs (:attr:`count`, or every job of :attr:`jobs`)."""
        return len(self.jobs) if self.count is None else self.count

    @property
    def sampled(self) -> bool:
        """Whether :attr:`jobs` are representatives of more jobs (a counted sweep)."""
        return self.count is not None

    @property
    def seconds(self) -> float:
        """The whole command: Python's start, then the jobs, ``parallel`` at a time (their sum divided by as many
        as run at once, the estimate of a machine whose cores the jobs share evenly, and never less than the
        longest job); a representative counts as the jobs it stands for. Jobs without an estimate (a GPU job
        planned without CUDA) count nothing."""
        timed = [j.seconds for j in self.jobs if j.seconds is not None]
        work = sum((j.seconds or 0.0) * j.weight for j in self.jobs)
        at_once = max(1, min(self.parallel, self.total))
        return START_S + max(work / at_once, max(timed, default=0.0) if at_once > 1 else 0.0)

    def estimates(self) -> dict[str, float]:
        """``{job number: seconds}`` (as strings: the sweep journal is JSON). A counted sweep of at most
        :data:`MAX_ESTIMATES` jobs: each job its shape's estimate (or the representatives' mean); a larger one:
        none."""
        if not self.sampled:
            return {str(j.number): float(j.seconds) for j in self.jobs if j.seconds is not None}
        if self.space is None or self.total > MAX_ESTIMATES:
            return {}
        timed = [j for j in self.jobs if j.seconds is not None]
        if not timed:
            return {}
        mean = sum(j.seconds * j.weight for j in timed) / sum(j.weight for j in timed)
        by_shape: dict[tuple[int, ...], list[float]] = {}
        for j in timed:
            by_shape.setdefault(j.shape or (), []).append(float(j.seconds))
        out = {}
        for n in range(self.total):
            times = by_shape.get(self.space.shape_of(n)) if self.grouped else None
            out[str(n)] = sum(times) / len(times) if times else mean
        return out


# ------------------------------------------------------------------------------------------------ planning


@contextlib.contextmanager
def _hydra() -> Any:
    """Hydra initialised on conf/ for the block (the running app's, at a sweep's start): one initialisation for
    every composition of a plan; yields its config loader (``glob()`` sweeps list a group's options through it)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from attnlab.training.config import CONF_DIR

    if GlobalHydra.instance().is_initialized():  # (a sweep's start: Hydra's app is running)
        yield GlobalHydra.instance().config_loader()
        return
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def _compose(overrides: Sequence[str], hydra_config: bool = False) -> DictConfig:
    """The config of ``overrides`` as a job would get it (inside a running Hydra app, through its own loader)."""
    from hydra import compose

    with _hydra():
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_config)


def _parse(arguments: Sequence[str]) -> list[Any]:
    """``arguments`` parsed by Hydra's own override parser (with the config loader, for ``glob()``), as its sweeper
    parses them; one line (:class:`ConfigError`) for what it cannot read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    from attnlab.training.config import ConfigError

    key = tuple(arguments)
    if key in _PARSED:  # (Hydra's parser takes about a second for a list of thousands of values: parsed once)
        return list(_PARSED[key])
    with _hydra() as loader:
        try:
            parsed = OverridesParser.create(config_loader=loader).parse_overrides(list(arguments))
        except Exception as exc:  # (Hydra's grammar errors are several lines)
            raise ConfigError(f"the sweep cannot be planned: {' '.join(str(exc).split())}") from None
    globbed = any(o.value_type == ValueType.GLOB_CHOICE_SWEEP for o in parsed)  # (listed through the loader)
    if not globbed:
        while len(_PARSED) >= 4:
            del _PARSED[next(iter(_PARSED))]
        _PARSED[key] = parsed
    return list(parsed)


_PARSED: dict[tuple[str, ...], list[Any]] = {}
"""The last few overrides :func:`_parse` read, and what Hydra's parser made of them."""


@dataclass
class _Space:
    """A basic sweep's jobs without listing them: each key (Hydra's order, its ``+``/``~`` kept) and its values as
    override text (a ``range`` of integers kept as one, never listed). Job ``n`` is the ``n``-th of the product
    of the values, the last key varying fastest (:meth:`BasicSweeper.split_arguments`'s order and numbering)."""

    keys: list[str]
    values: list[Sequence[Any]]

    @property
    def count(self) -> int:
        return math.prod(len(v) for v in self.values)

    def swept(self) -> list[int]:
        """The keys (their indices) with more than one value."""
        return [i for i, v in enumerate(self.values) if len(v) > 1]

    def shaped(self) -> list[int]:
        """The swept keys that may change a job's time (not :data:`COST_FREE_KEYS`)."""
        return [i for i in self.swept() if self.keys[i].lstrip("+~") not in COST_FREE_KEYS]

    def digits(self, number: int) -> list[int]:
        out = [0] * len(self.values)
        for i in reversed(range(len(self.values))):
            number, out[i] = divmod(number, len(self.values[i]))
        return out

    def number(self, digits: Sequence[int]) -> int:
        n = 0
        for d, v in zip(digits, self.values, strict=True):
            n = n * len(v) + d
        return n

    def shape_of(self, number: int) -> tuple[int, ...]:
        digits = self.digits(number)
        return tuple(digits[i] for i in self.shaped())

    def job(self, number: int) -> list[str]:
        """Job ``number``'s overrides (``key=value`` each, as Hydra's sweeper writes them)."""
        values = zip(self.keys, self.values, self.digits(number), strict=True)
        return [f"{k}={_value_text(v[d])}" for k, v, d in values]


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


def _space(arguments: Sequence[str], more: Sequence[str] = ()) -> _Space:
    """The basic sweeper's jobs of ``arguments`` then ``more`` (the sweeper's ``params``, then the command line's):
    each override as its sweeper reads it (a sweep's values from Hydra's own expansion, ``choice()``, ``range()``,
    ``glob()`` and ``a,b`` alike; a later override of the same key replaces the earlier in its place), counted, not
    listed."""
    from attnlab.training.config import ConfigError

    values: dict[str, Sequence[Any]] = {}
    with _hydra():
        for override in [*(_parse(arguments) if arguments else []), *(_parse(more) if more else [])]:
            key = override.get_key_element()
            if not override.is_sweep_override():
                values[key] = [override.get_value_element_as_str()]
                continue
            if not override.is_discrete_sweep():
                raise ConfigError(
                    f"the sweep cannot be planned: BasicSweeper does not support sweep type : "
                    f"{override.value_type.name} ({override.input_line}; interval() is for hydra/sweeper=optuna)"
                )
            value = override.value()
            lazy = value.range() if override.is_range_sweep() and not value.shuffle else None
            if isinstance(lazy, range):  # counted, never listed: range(0,10**9) costs nothing
                values[key] = lazy
                continue
            listed = list(itertools.islice(override.sweep_string_iterator(), MAX_VALUES + 1))
            if len(listed) > MAX_VALUES:
                raise ConfigError(
                    f"the sweep cannot be planned: {override.input_line} has more than {MAX_VALUES:,} values"
                )
            values[key] = listed
    return _Space(list(values), list(values.values()))


def _first_values(arguments: Sequence[str]) -> list[str]:
    """``arguments`` with each sweep at its first value, as Hydra expands it (``d_k=8,16`` → ``d_k=8``,
    ``d_k=range(8,65,8)`` → ``d_k=8``, ``lr=choice(1e-3,1e-2)`` → ``lr=0.001``); an ``interval()`` (Optuna's) is
    left out: the config's own value."""
    out = []
    with _hydra():
        for override in _parse(arguments):
            if not override.is_sweep_override():
                out.append(override.input_line)
            elif override.is_discrete_sweep():
                first = next(iter(override.sweep_string_iterator()), None)
                if first is not None:
                    out.append(f"{override.get_key_element()}={first}")
    return out


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
    with _hydra():  # (one initialisation for every composition of the plan)
        if not multirun:
            plan = Plan("run", [Job(0, task_args)])
        else:
            try:
                root = _compose(hydra_args + _first_values(task_args), hydra_config=True)
            except ConfigError:
                raise
            except Exception as exc:  # (Hydra's own errors are several lines)
                error = " ".join(str(exc).split())
                raise ConfigError(missing_plugin(error, args) or f"the sweep cannot be planned: {error}") from None
            check_sweep_config(args)
            target = str(OmegaConf.select(root, "hydra.sweeper._target_") or "")
            if target.endswith("TunedSweeper"):
                plan = _tuned_plan(root, task_args)
            elif "optuna" in target.lower():
                trials = int(OmegaConf.select(root, "hydra.sweeper.n_trials") or 0)
                base = _first_values(task_args)
                note = "a trial: its point is Optuna's choice"
                plan = Plan("optuna", [Job(n, base, note=note) for n in range(trials)])
                plan.notes.append(f"Optuna: {trials} trials, each estimated at the command line's first values")
            else:
                params = [f"{k}={v}" for k, v in (OmegaConf.select(root, "hydra.sweeper.params") or {}).items()]
                plan = _sweep_plan(_space(params, task_args))
        if multirun:
            _launcher(plan, root)
        plan.machine = measure()  # (once: every job's threads are chosen from it, as its run would choose them)
        plan.choice = _job_threads(plan, _given_threads(task_args))
        plan.threads = plan.choice.threads
        if not plan.sampled:
            _varying_labels(plan.jobs)
        if plan.tuned is not None:  # a seed job's grid keys: the chosen point, not known before the grid has run
            for job in plan.jobs:
                if job.stage == "seeds":
                    job.label = " ".join(
                        f"{k}=(chosen)" if (k := part.split("=", 1)[0]) in plan.tuned["grid"] else part
                        for part in job.label.split(" ")
                    )
        folders = _folder_check(plan, hydra_args)
        _cost(plan, fresh, log or (lambda _: None), folders)
    plan.notes += _closing_notes(plan)
    return plan


def _numbers(jobs: Sequence[Job]) -> str:
    shown = ", ".join(str(j.number) for j in jobs[:8])
    return (
        f"job {shown}" if len(jobs) == 1 else f"jobs {shown}" + (f" and {len(jobs) - 8} more" if len(jobs) > 8 else "")
    )


def _closing_notes(plan: Plan) -> list[str]:
    """What the estimate could not do, and why: GPU jobs without CUDA here, a SLURM sweep timed here, a machine
    that other work keeps busy, jobs with more threads than free cores, settings that differ between the jobs."""
    notes = []
    machine, built = plan.machine, [j for j in plan.jobs if j.error is None and j.steps is not None]
    gpu = [j for j in built if j.gpu]
    if gpu:
        one = len(gpu) == 1
        notes.append(
            f"{_numbers(gpu)} {'trains' if one else 'train'} on a GPU (trainer.accelerator={gpu[0].accelerator}) and "
            f"torch sees no CUDA on this machine: {'its' if one else 'their'} steps, tokens and FLOPs per step are "
            f"counted, but {'its' if one else 'their'} time cannot be estimated here (a CPU's step says nothing of "
            "a GPU's), and a run here would be refused: plan it on the GPU machine for its minutes"
        )
    timed = [j for j in built if j.step_s is not None]
    if plan.remote and plan.launcher is not None:
        cpus = plan.cpus_per_task
        own = f"hydra.launcher.cpus_per_task={cpus}" if cpus else f"{plan.threads} thread(s)"
        if plan.timing_threads is not None and machine is not None:
            how = (
                f"with {plan.timing_threads} thread(s): the jobs' {own} is more than the {machine.free} core(s) "
                f"free here, so it cannot be timed as the cluster runs it (expect a job there to be faster)"
            )
        else:
            how = f"with the jobs' {own}"
        notes.append(
            f"the jobs run on the {plan.remote} cluster, not here: each job's time is estimated on this machine "
            f"{how}; the queue's wait is not in it, and nothing here needs srun"
        )
        gpus = plan.launcher.get("gpus_per_node") or plan.launcher.get("gpus_per_task")
        auto = [j for j in built if j.accelerator == "auto"]
        if gpus and auto and isinstance(gpus, int):
            notes.append(
                f"the launcher gives each job {gpus} GPU(s) (hydra.launcher.gpus_per_node={gpus}) and trainer=auto "
                "trains on it there: the times here are a CPU's, not the GPU's (a CPU job on the cluster: "
                "trainer=cpu hydra.launcher.gpus_per_node=0)"
            )
        limit = plan.launcher.get("timeout_min")
        if isinstance(limit, int | float) and limit > 0:
            over = [j for j in timed if j.seconds is not None and j.seconds > 60 * limit]
            if over:
                notes.append(
                    f"{_numbers(over)} {'is' if len(over) == 1 else 'are'} estimated here at more than the "
                    f"launcher's timeout_min ({limit}): SLURM "
                    "stops a job at its limit (raise hydra.launcher.timeout_min)"
                )
    if machine is not None and timed and machine.is_busy:
        tries = ["wait for the other work to end, then --dry-run again"]
        threads = max((j.threads or plan.threads) for j in timed)
        if threads > 1:
            tries.append("run with threads=1")
        if plan.parallel > 1 and not plan.remote:
            tries.append("run fewer jobs at once (hydra.launcher.n_jobs=1)")
        chosen = " (threads=auto chose 1 thread a job already)" if threads == 1 and plan.choice is not None else ""
        slowed = "the timing here" if plan.remote else "each step timed here (and the run, if it starts now)"
        notes.append(
            f"this machine is busy: other work takes {machine.taken:.1f} of the {machine.cores} core(s) this "
            f"process may have, so "
            f"{slowed} is slower than on an idle machine; to go faster: {', or '.join(tries)}{chosen}"
        )
    after = plan.machine_after
    if machine is not None and after is not None and machine.busy is not None and after.busy is not None:
        if abs(after.busy - machine.busy) >= 0.5 and after.is_busy != machine.is_busy:
            notes.append(
                f"the machine's other work changed while the steps were timed ({machine.busy:.1f} core(s) busy at "
                f"the start, {after.busy:.1f} at the end): the step times may be off; --dry-run again when it is "
                "steady"
            )
    if machine is not None and timed and not plan.remote and plan.choice is not None:
        many = [j for j in timed if (j.threads or 0) * (1 if plan.parallel <= 1 else plan.parallel) > machine.free]
        if many and plan.choice.source != "auto":
            at_once = f" each, {plan.parallel} jobs at a time" if plan.parallel > 1 else ""
            notes.append(
                f"{_numbers(many)} {'runs' if len(many) == 1 else 'run'} with {many[0].threads} thread(s){at_once} "
                f"({plan.choice.reason}), more than the {machine.free} core(s) free now: each step waits for busy "
                f"cores (threads=auto would take {max(1, machine.free // max(1, plan.parallel))})"
            )
    if plan.differing:
        notes.append(f"settings that differ between the jobs besides the swept keys: {_differing_text(plan.differing)}")
    return notes


def _differing_text(differing: dict[str, dict[str, str]]) -> str:
    """``short_conv (kda 4, rwkv7 2, scaled_dot none); mask (...)``; more than 8 jobs: grouped by value."""
    from attnlab.runs import attention_sources

    parts = []
    sources = attention_sources()
    for name, values in differing.items():
        key = sources.get(name)
        label = f"{name} [{key}]" if key and key not in (name, f"{name}.name") else name
        if len(values) <= 8:
            shown = ", ".join(f"{job} {value}" for job, value in values.items())
        else:
            groups: dict[str, list[str]] = {}
            for job, value in values.items():
                groups.setdefault(value, []).append(job)
            shown = "; ".join(
                f"{value}: {', '.join(jobs[:6])}" + (f" and {len(jobs) - 6} more" if len(jobs) > 6 else "")
                for value, jobs in groups.items()
            )
        parts.append(f"{label} ({shown})")
    return "; ".join(parts)


def _sweep_plan(space: _Space) -> Plan:
    """A basic sweep's plan: every job (at most :data:`FULL_PLAN_JOBS`), else the count and representatives."""
    count = space.count
    if count <= FULL_PLAN_JOBS:
        return Plan("sweep", [Job(n, space.job(n)) for n in range(count)])
    swept, shaped = space.swept(), space.shaped()
    shapes = math.prod(len(space.values[i]) for i in shaped)
    longest = max(len(space.values[i]) for i in swept)
    rng = random.Random(0)
    chosen: list[list[int]] = []
    size = 0
    if shapes <= MAX_SAMPLE_JOBS:  # every shape once; more (the shapes again) for the cost-free keys' values
        free = [i for i in swept if i not in shaped]
        reps = max(shapes, min(SAMPLE_JOBS, max((len(space.values[i]) for i in free), default=1)))
        grid = list(itertools.product(*(range(len(space.values[i])) for i in shaped)))
        for r in range(reps):
            digits = [0] * len(space.values)
            for i, d in zip(shaped, grid[r % shapes], strict=True):
                digits[i] = d
            for i in free:
                digits[i] = r % len(space.values[i])
            chosen.append(digits)
    else:  # a Latin-hypercube sample: each key's values in a random order (repeated), one column per key
        size = min(MAX_SAMPLE_JOBS, max(SAMPLE_JOBS, longest))
        columns = {}
        for i in swept:
            n = len(space.values[i])
            if n >= size:
                columns[i] = rng.sample(range(n), size)
            else:
                columns[i] = [d for _ in range(-(-size // n)) for d in rng.sample(range(n), n)][:size]
        chosen = [[columns[i][r] if i in columns else 0 for i in range(len(space.values))] for r in range(size)]
    numbers = sorted({space.number(d) for d in chosen})
    plan = Plan("sweep", [], count=count, space=space, grouped=shapes <= MAX_SAMPLE_JOBS)
    per_shape: dict[tuple[int, ...], int] = {}
    for n in numbers:
        per_shape[space.shape_of(n)] = per_shape.get(space.shape_of(n), 0) + 1
    for n in numbers:
        overrides, shape = space.job(n), space.shape_of(n)
        weight = count / shapes / per_shape[shape] if plan.grouped else count / len(numbers)
        label = " ".join(o for i, o in enumerate(overrides) if i in swept) or "(the defaults)"
        plan.jobs.append(Job(n, overrides, label=label, weight=weight, shape=shape))
    sizes = " × ".join(f"{space.keys[i]} {len(space.values[i]):,}" for i in swept)
    if plan.grouped:
        cost_free = ", ".join(space.keys[i] for i in swept if i not in shaped) or "no key"
        how = (
            f"jobs that differ only in {cost_free} take the same time, and the other keys make {shapes:,} distinct "
            f"shape(s): each shape was built ({len(numbers)} job(s) in all), and the total is each shape's time × "
            f"its {count // shapes:,} jobs"
        )
    else:
        how = (
            f"{len(numbers)} representative jobs were drawn (a Latin-hypercube sample, seed 0: every value of a key "
            f"with at most {size} values is in one of them), and the total is their mean × the count"
        )
    plan.notes.append(
        f"{count:,} jobs is a count ({sizes} values), not a list: too many to compose and check one by one (over "
        f"{FULL_PLAN_JOBS}); {how}. The other jobs were not built: a value that only they hold is not checked"
    )
    return plan


def _launcher(plan: Plan, root: DictConfig) -> None:
    """The multirun's launcher, as its jobs will meet it: how many run at once and with how many cores each
    (:func:`attnlab.training.config.compose.launcher_share`: joblib's ``n_jobs``, submitit's ``cpus_per_task``), and
    for SLURM (the jobs run on a cluster, not here) its settings and ``array_parallelism``."""
    from attnlab.training.config.compose import launcher_share

    launcher = OmegaConf.select(root, "hydra.launcher") or OmegaConf.create({})
    target = str(launcher.get("_target_", "") or "")
    if "submitit" in target.lower() and target.endswith("SlurmLauncher"):
        plan.remote = "SLURM"
        plan.launcher = _launcher_settings(launcher)
        plan.parallel = max(1, int(launcher.get("array_parallelism") or 1))
        cpus = launcher.get("cpus_per_task")
        plan.cpus_per_task = int(cpus) if cpus else None
        return
    plan.parallel, plan.cpus_per_task = launcher_share(launcher)


_LAUNCHER_HIDDEN = ("_target_", "submitit_folder", "name", "stderr_to_stdout", "setup")
"""A SLURM launcher's keys the plan does not print: where submitit writes, and how (not what the job gets)."""


def _launcher_settings(launcher: DictConfig) -> dict[str, Any]:
    """A SLURM launcher's settings as the sbatch script gets them: every key that is set (``partition`` always,
    null: the cluster's default), interpolations left as written."""
    node = OmegaConf.to_container(launcher, resolve=False)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _LAUNCHER_HIDDEN or (value in (None, {}, []) and key != "partition"):
            continue
        out[str(key)] = value
    return out


_PLUGIN_CONFIGS = {
    "hydra/launcher/submitit_": ("hydra-submitit-launcher", "slurm"),
    "hydra/sweeper/optuna": ("hydra-optuna-sweeper", "optuna"),
}
"""The config a Hydra plugin registers (as Hydra names it when it cannot load it) → the plugin and attnlab's extra."""


def missing_plugin(error: str, args: Sequence[str] = ()) -> str | None:
    """One line for Hydra's composition ``error`` when it is an optional plugin's config that is not there (the
    plugin is not installed: ``hydra/launcher=slurm`` without the slurm extra), naming the choice of ``args`` (the
    command line's overrides) that asks for it; else None. A plan reads a launcher's settings from its plugin, so it
    needs it too (but never ``srun``)."""
    for config, (plugin, extra) in _PLUGIN_CONFIGS.items():
        if f"load '{config}" in error or f"find '{config}" in error:
            groups = ("hydra/launcher",) if "launcher" in config else ("hydra/sweeper", "hparams_search")
            given = [a for a in args if a.split("=", 1)[0].lstrip("+~").removeprefix("override ").strip() in groups]
            choice = given[-1] if given else config.rstrip("_")
            what = "the launcher's settings from it; no cluster is needed" if "launcher" in config else "its settings"
            return (
                f"{choice} needs the {extra} extra ({plugin}), which is not installed here: pip install -e "
                f"'.[{extra}]' (the plan reads {what})"
            )
    return None


def _given_threads(task_args: Sequence[str]) -> Any:
    """The command line's last ``threads=`` (an integer as one), or ``auto``."""
    given = [a.split("=", 1)[1] for a in task_args if a.split("=", 1)[0].lstrip("+~") == "threads"]
    value = given[-1].strip() if given else "auto"
    return int(value) if value.isdigit() else value


def _job_threads(plan: Plan, setting: Any) -> ThreadChoice:
    """The threads a job of ``plan`` with ``threads=<setting>`` runs with, on the plan's measurement of this machine
    (:func:`attnlab.cores.choose_threads`: the rule :func:`attnlab.training.config.set_threads` runs with)."""
    parallel = 1 if plan.remote else plan.parallel
    return choose_threads(plan.machine, parallel, setting, plan.cpus_per_task)


def check_sweep_config(args: Sequence[str]) -> None:
    """Refuse in one line (:class:`~attnlab.training.config.ConfigError`), before Hydra does in several, a sweep whose
    fixed overrides do not compose without its swept ones: Hydra builds the sweep's own config from the overrides
    that are not swept, with every swept group at its default, so ``variant=deltanet,gated_deltanet
    variant.params.beta_range=2`` fails (the default variant has no ``beta_range``) although each of its jobs
    composes. ``args``: a multirun's overrides (``-m`` and ``--dry-run`` left out)."""
    from attnlab.training.config import ConfigError

    hydra_args = [a for a in args if a.split("=", 1)[0].lstrip("+~").startswith("hydra")]
    task_args = [a for a in args if a not in hydra_args]
    try:
        parsed = _parse(task_args)
    except ConfigError:  # (reported with the jobs)
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
            f"{', '.join(swept)} at their defaults, and that fails: {' '.join(str(exc).split())}; sweep named models "
            f"that carry the setting (variant=deltanet_beta2,gated_deltanet_beta2: python -m attnlab.compare lists "
            f"them), or write a comparison (python train.py -m compare=<file>: docs/compare.md)"
        ) from None


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


_FolderSpec = Callable[[Job], tuple[list[str], int | None]]
"""A job → the Hydra overrides to compose it with for its run folder, and its number (None: a single run)."""


def _cost(plan: Plan, fresh: bool, log: Callable[[str], None], folders: _FolderSpec | None = None) -> None:
    """Compose and check each job's config (and its run folder, ``folders``), count its FLOPs, time (or look up)
    its model's step, estimate it."""
    import torch

    threads_before = torch.get_num_threads()
    try:
        _cost_jobs(plan, fresh, log, folders)
    finally:
        torch.set_num_threads(threads_before)
    if plan.timed_models and plan.machine is not None and plan.machine.busy is not None:
        plan.machine_after = measure()  # (other work that began or ended while the steps were timed)


_OUTCOME = (
    "steps",
    "batch_size",
    "seq_len",
    "flops_per_step",
    "step_s",
    "seconds",
    "error",
    "note",
    "threads",
    "gpu",
    "accelerator",
)


def _wants_gpu(cfg: DictConfig) -> bool:
    """Whether the job's trainer asks for a GPU (``trainer=gpu``, ``gpu_bf16``, ``trainer.accelerator=gpu``) and
    torch sees no CUDA here: a job that can be counted here, not timed."""
    import torch

    accelerator = str(OmegaConf.select(cfg, "trainer.accelerator") or "auto")
    return accelerator in ("gpu", "cuda") and not torch.cuda.is_available()


def _timing_threads(plan: Plan, job: Job) -> int:
    """The threads ``job``'s steps are timed with here: its own (as it will run), but for a job that runs on another
    machine (SLURM) no more than this machine has free (a step with more threads than free cores is timed wrong)."""
    threads = job.threads or plan.threads
    if plan.remote and plan.machine is not None and threads > plan.machine.free:
        plan.timing_threads = plan.machine.free
        return plan.machine.free
    return threads


def _cost_jobs(plan: Plan, fresh: bool, log: Callable[[str], None], folders: _FolderSpec | None) -> None:
    import torch

    from attnlab.training.config import ConfigError

    cache = _Cache.load()
    configs: dict[int, DictConfig] = {}  # (the built jobs' configs: what differs between them besides the swept keys)
    models: dict[str, tuple[float | None, Any]] = {}
    built: dict[tuple[Any, ...], Job] = {}  # jobs of the same overrides and folder (Optuna's trials): built once
    started = time.perf_counter()
    for job in plan.jobs:
        spec = folders(job) if folders is not None else None
        same = built.get((*job.overrides, repr(spec)))
        if same is not None:
            for name in _OUTCOME:
                setattr(job, name, getattr(same, name))
            continue
        built[(*job.overrides, repr(spec))] = job
        try:
            cfg, datamodule, module, folder = _build(job.overrides, spec, elsewhere=plan.remote is not None)
            from_step = _inspect_folder(cfg, folder, job) if folder is not None else 0
        except ConfigError as exc:
            job.error = str(exc)
            continue
        except Exception as exc:  # a job the sweep would see fail: say so, plan the others
            job.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
            continue
        job.steps, job.batch_size, job.seq_len = int(cfg.max_steps), datamodule.batch_size, datamodule.seq_len
        choice = _job_threads(plan, cfg.get("threads", "auto"))
        if not configs:  # (the first built job's: the plan's line says it)
            plan.choice, plan.threads = choice, choice.threads
        job.threads = choice.threads
        job.accelerator = str(OmegaConf.select(cfg, "trainer.accelerator") or "auto")
        configs[job.number] = cfg
        if from_step is None:  # a complete run asked to resume: the command changes nothing
            job.seconds = 0.0
            continue
        if _wants_gpu(cfg):  # counted, not timed: a CPU step says nothing of a GPU's
            job.gpu = True
            job.flops_per_step = _flops(module, datamodule)
            continue
        torch.set_num_threads(_timing_threads(plan, job))  # (timed as it will run, keyed by it in the cache)
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
            job.seconds = estimate_job(cfg, datamodule, job.step_s, plan.kind != "run", from_step=from_step)
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
    try:
        plan.differing = _differing(plan, configs)
    except Exception:  # (a report: a config it cannot read is the jobs' own refusal, said above)
        plan.differing = {}


def _build(
    overrides: Sequence[str], folder: tuple[list[str], int | None] | None = None, elsewhere: bool = False
) -> tuple[DictConfig, Any, Any, Path | None]:
    """A job's config, checked as the run checks it before writing anything (:class:`ConfigError` in one line),
    its datamodule, its model, and, with ``folder`` (Hydra's overrides and the job's number: :func:`_job_folder`),
    its run folder where it exists (composed once: the config is the same as without Hydra's node, as
    :func:`hydra.compose` makes it). A job that runs on another machine (``elsewhere``: SLURM's; or a GPU trainer
    here without CUDA) is checked as it will be there (:func:`~attnlab.training.config.validate.planned_elsewhere`)
    and built on the CPU, for its counts."""
    from omegaconf import open_dict

    from attnlab.training.config import (
        build_module,
        check_resolves,
        import_user_modules,
        resolve_match,
        validate_config,
    )
    from attnlab.training.config.validate import planned_elsewhere

    path = None
    if folder is None:
        cfg = _compose(overrides)
    else:
        cfg = _compose([*folder[0], *overrides], hydra_config=True)
        path = _job_folder(cfg, folder[1])
        with open_dict(cfg):  # (what hydra.compose does without return_hydra_config)
            del cfg["hydra"]
    check_resolves(cfg)
    import_user_modules(cfg)
    there = planned_elsewhere() if elsewhere or _wants_gpu(cfg) else contextlib.nullcontext()
    with _quiet(), there:
        datamodule = validate_config(cfg)
        if resolve_match(cfg, datamodule) is not None:
            datamodule = validate_config(cfg)
        module = build_module(cfg, datamodule)
    return cfg, datamodule, module, path


def _folder_check(plan: Plan, hydra_args: Sequence[str]) -> _FolderSpec | None:
    """Where the command line names a run folder that may hold a run already (``hydra.run.dir`` of a single run,
    ``hydra.sweep.dir`` of a basic sweep: the tuned sweeper checks its own folder when it starts, and an Optuna
    trial's folder is named by its point): for each job, the Hydra overrides to compose it with and its number
    (None for a single run). None where no job's folder can hold a run (Hydra's default folders are new, named by
    the time)."""
    given = {a.split("=", 1)[0].lstrip("+~") for a in hydra_args if "=" in a}
    if plan.kind == "run" and "hydra.run.dir" in given:
        return lambda job: (list(hydra_args), None)
    if plan.kind == "sweep" and "hydra.sweep.dir" in given:
        return lambda job: (list(hydra_args), job.number)
    return None


def _job_folder(root: DictConfig, number: int | None) -> Path | None:
    """The run folder of the job composed as ``root`` (Hydra's node kept), as Hydra names it: ``hydra.run.dir`` of a
    single run (``number`` None), else ``hydra.sweep.dir``/``hydra.sweep.subdir`` with ``hydra.job.num`` =
    ``number`` (``hydra.job.override_dirname`` is the job's overrides', as its launcher composes them). None when it
    does not exist yet or cannot be told (a folder that is not there holds no run)."""
    from omegaconf import open_dict, read_write

    try:
        if number is None:
            path = Path(str(OmegaConf.select(root, "hydra.run.dir", throw_on_resolution_failure=True)))
        else:
            with read_write(root.hydra), open_dict(root.hydra):
                root.hydra.job.num = number  # (as the launcher sets it)
            sweep = Path(str(root.hydra.sweep.dir))
            if not sweep.is_dir():
                return None
            path = sweep / str(root.hydra.sweep.subdir)
    except Exception:  # (an interpolation that only the running app resolves)
        return None
    return path if os.path.lexists(path) else None


def _inspect_folder(cfg: DictConfig, folder: Path, job: Job) -> int | None:
    """What the run would decide of ``folder`` before it trains, by its own checks and words
    (:meth:`attnlab.training.lifecycle.Run.inspect_folder`; the imports a resume would take from the folder; the
    folder's lock): raises :class:`ConfigError` with the refusal the command would print; else the step the run
    starts from (0 for a new run, the run's steps for a resume), or None for a complete run asked to resume (it
    changes nothing). Only reads."""
    from attnlab.runs import RunFileError, RunFolder, RunFolderBusy
    from attnlab.training.config import ConfigError
    from attnlab.training.lifecycle import Run, _one_line, shown

    if RunFolder(folder).is_active():  # another process writes it: the run would wait for its lock, then give up
        raise ConfigError(RunFolder(folder).busy_message())
    run = Run(cfg, folder)
    try:
        if run.resuming:
            run._check_stored_imports()
        run.inspect_folder()
    except (ConfigError, RunFolderBusy, RunFileError) as exc:
        raise ConfigError(_one_line(exc)) from None
    previous = run.previous
    if run.complete:
        steps = previous.steps if previous is not None else "?"
        job.note = f"the run in {shown(folder)} is complete ({steps} steps): the command would change nothing"
        return None
    if run.kind in ("resume", "extend") and previous is not None:
        job.note = f"{run.kind}s the run in {shown(folder)} from step {previous.steps or 0}"
        return int(previous.steps or 0)
    return 0


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


def estimate_job(cfg: DictConfig, datamodule: Any, step_s: float, multirun: bool, from_step: int = 0) -> float:
    """The estimated seconds of one job (see the module docstring): its steps at ``step_s`` each (those after
    ``from_step``: a resume), its evaluations, its test, its head step and :data:`JOB_OVERHEAD_S`."""
    steps = max(0, int(cfg.max_steps) - int(from_step))
    eval_s = step_s * EVAL_FRACTION
    val, test = _batches(cfg, datamodule, "val"), _batches(cfg, datamodule, "test")
    evaluations = math.ceil(steps / max(1, int(cfg.eval_every))) + 1
    seconds = steps * step_s + evaluations * (val + 1) * eval_s + test * eval_s + JOB_OVERHEAD_S
    if head_step_on(cfg, multirun):
        heads = int(cfg.num_heads) * int(cfg.num_layers)
        orders = 1 + int(cfg.diagnostics.get("random_orders", 1) or 0)
        seconds += val * step_s + (1 + heads) * orders * test * eval_s
    return seconds


# ----------------------------------------------------------------------------------- what differs between jobs


_NOT_COMPARED = ("hydra", "attention", "model.layer_kinds", "model.layers")
"""Config keys :func:`differing_settings` leaves out: Hydra's node (the job's folder and number), and the nodes
whose effect it compares as built (each layer's :class:`~attnlab.config.AttentionConfig`)."""
_FORM_FIELDS = ("score", "score_params")
"""The form's own parameters: they differ between the forms of a sweep by what it compares."""


def _setting_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return str(value)


def _under(key: str, keys: Iterable[str]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


def _job_settings(cfg: DictConfig, swept: set[str]) -> dict[str, str]:
    """One job's settings as text: each field of its layers' attention configs (one value, or the layers' joined
    by `` / ``), then every other config key (its leaves, resolved), leaving out the swept keys, the form's own
    parameters (:data:`_FORM_FIELDS`) and :data:`_NOT_COMPARED`. A field and the config key it comes from
    (``short_conv`` ← ``model.short_conv``) are compared once, as the field."""
    from attnlab.config import FIELDS, _mask_text
    from attnlab.runs import attention_sources
    from attnlab.training.config import attention_configs

    sources = attention_sources()
    out: dict[str, str] = {}
    layers = attention_configs(cfg)
    for name in FIELDS:
        source = sources.get(name, f"attention.{name}")
        if name in _FORM_FIELDS or _under(source, swept) or f"attention.{name}" in swept:
            continue
        texts = [_mask_text(c.mask) if name == "mask" else _setting_text(getattr(c, name)) for c in layers]
        out[name] = texts[0] if len(set(texts)) == 1 else " / ".join(texts)
    skipped = (*_NOT_COMPARED, *sources.values(), *swept)
    for key, value in _leaves(OmegaConf.to_container(cfg, resolve=True)).items():
        if key and not _under(key, skipped):
            out[key] = _setting_text(value)
    return out


def differing_settings(jobs_configs: Mapping[str, DictConfig], swept: Iterable[str] = ()) -> dict[str, dict[str, str]]:
    """The settings that differ between jobs, besides the swept keys: ``{setting: {job: value}}`` for every
    setting whose value is not the same in all of ``jobs_configs`` (``{job label: its composed and checked
    config}``), in the order of the first job's settings. A setting is a field of the jobs' built attention
    (``short_conv``, ``mask``, ``normalizer`` ...: :func:`~attnlab.training.config.attention_configs`, each layer's
    :class:`~attnlab.config.AttentionConfig`; layers that differ are joined by `` / ``) or any other config key
    (``model.d_ff``, ``lr``), as text (``none`` for null). Left out: ``swept`` (the keys the command sweeps, and the
    keys under them: ``variant`` covers ``variant.params``), the form's own parameters (``score``,
    ``score_params``), Hydra's node, and the per-layer nodes (compared as built). A sweep over forms whose presets
    set other keys (``variant=kda`` sets ``model.short_conv=4``, ``rwkv7`` 2, ``gated_deltanet`` none) thus says
    so, instead of comparing them silently."""
    keys = {k.lstrip("+~").removeprefix("override ").strip() for k in swept}
    per_job = {label: _job_settings(cfg, keys) for label, cfg in jobs_configs.items()}
    if len(per_job) < 2:
        return {}
    names: list[str] = []
    for settings in per_job.values():
        names += [n for n in settings if n not in names]
    out: dict[str, dict[str, str]] = {}
    for name in names:
        values = {label: settings.get(name, "(unset)") for label, settings in per_job.items()}
        if len(set(values.values())) > 1:
            out[name] = values
    return out


def _differing(plan: Plan, configs: dict[int, DictConfig]) -> dict[str, dict[str, str]]:
    """:func:`differing_settings` of the plan's built jobs, each named by its values of the swept keys that shape a
    job (one key: its value alone, ``kda``), the first job of each name standing for the others (a tuned sweep's
    grid points and seeds, :data:`COST_FREE_KEYS`, are swept keys too)."""
    from attnlab.training.multirun import varying_keys

    pairs = [dict(o.split("=", 1) for o in job.overrides if "=" in o) for job in plan.jobs]
    swept = set(varying_keys(pairs)) if len(pairs) > 1 else set()
    if plan.space is not None:
        swept |= {plan.space.keys[i] for i in plan.space.swept()}
    if plan.tuned is not None:
        swept |= set(plan.tuned["grid"])
    naming = [
        k for k in dict.fromkeys(k for p in pairs for k in p) if k in swept and k.lstrip("+~") not in COST_FREE_KEYS
    ]
    named: dict[str, DictConfig] = {}
    for job, p in zip(plan.jobs, pairs, strict=True):
        if job.number not in configs:
            continue
        parts = [p.get(k, "-") for k in naming] if len(naming) == 1 else [f"{k}={p[k]}" for k in naming if k in p]
        named.setdefault(" ".join(parts) or f"job {job.number}", configs[job.number])
    return differing_settings(named, swept) if len(named) > 1 else {}


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
    counted = f" (a count: {len(plan.jobs)} representative(s) below)" if plan.sampled else ""
    console.print(
        f"dry run: {command} — {kinds[plan.kind]} of {plan.total:,} job(s){counted}; nothing was run or written"
    )
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
        elif job.note and plan.kind in ("run", "sweep"):
            console.print(f"  job {job.number}: {job.note}")
    if plan.launcher is not None:
        settings = " ".join(
            f"{k}={'(the cluster default)' if v is None else _launcher_value(v)}" for k, v in plan.launcher.items()
        )
        console.print(f"{plan.remote.lower() if plan.remote else 'launcher'}: each job is one sbatch job: {settings}")
    estimated = [j for j in plan.jobs if j.seconds is not None]
    total = plan.seconds
    of = (
        f"{len(estimated)} of the {len(plan.jobs)} representative jobs estimated, each standing for its share of "
        f"the {plan.total:,}"
        if plan.sampled
        else f"{len(estimated)} of {len(plan.jobs)} jobs estimated"
    )
    threads = sorted({j.threads for j in plan.jobs if j.threads is not None}) or [plan.threads]
    per_job = f"{threads[0]}" if len(threads) == 1 else f"{threads[0]}-{threads[-1]}"
    timed_with = f", timed here with {plan.timing_threads}" if plan.timing_threads is not None else ""
    if estimated or not any(j.gpu for j in plan.jobs):
        console.print(
            f"estimated: {minutes(total)} in all ({total / 60:.1f} min, {_at_once(plan.parallel, plan.remote)}; {of}"
            f"), {per_job} thread(s) a job{timed_with} · step times: {plan.timed_models} model(s) timed now, "
            f"{plan.cached_models} from the cache ({plan.timing_s:.1f} s)"
        )
    else:
        console.print(f"estimated: no time ({of}: GPU jobs, and torch sees no CUDA here), {per_job} thread(s) a job")
    if plan.machine is not None:
        console.print(f"machine: {_machine_line(plan)}")
    for note in plan.notes:
        console.print(f"note: {note}")
    refused = [j for j in plan.jobs if j.error]
    if refused and plan.sampled:
        share = sum(j.weight for j in refused)
        console.print(
            f"{len(refused)} of the {len(plan.jobs)} representative jobs would be refused (they stand for about "
            f"{share:,.0f} of the {plan.total:,} jobs): the sweep runs the others and exits 1"
        )
    elif refused and plan.kind == "run":
        console.print("the command would be refused: it would print the error below, change nothing and exit 2")
    elif refused:
        console.print("some jobs would be refused: the sweep runs the others and exits 1")


def _at_once(parallel: int, remote: str | None = None) -> str:
    where = f" on the {remote} cluster" if remote else ""
    return f"one job at a time{where}" if parallel <= 1 else f"up to {parallel} jobs at a time{where}"


def _launcher_value(value: Any) -> str:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, dict | list) else str(value)


def _machine_line(plan: Plan) -> str:
    """``2 core(s) for this process, 1.7 busy with other work now (load 3.9); jobs will run with 1 thread each
    (threads=auto: 1 of 2 core(s) free)``; for SLURM, this machine's, then the cluster's jobs'."""
    machine, choice = plan.machine, plan.choice
    why = f" ({choice.reason})" if choice is not None else ""
    each = "each" if plan.total > 1 else ""
    if plan.remote:
        timed = plan.timing_threads if plan.timing_threads is not None else plan.threads
        return (
            f"{machine.describe()}; the jobs will run on the {plan.remote} cluster with {plan.threads} thread(s) "
            f"{each}{why}, timed here with {timed}".replace("  ", " ")
        )
    run = "the job will run" if plan.total == 1 else "jobs will run"
    return f"{machine.describe()}; {run} with {plan.threads} thread(s) {each}{why}".replace("  ", " ")


def dry_run(argv: list[str], given: Sequence[str] | None = None) -> int:
    """``python train.py ... --dry-run``: print the plan; exit code 0, or 2 when every job would be refused.
    ``given``: the command line as typed, where ``argv`` is its expansion (``compare=<name>``:
    :func:`attnlab.training.compare.expand_compare`); the plan names both."""
    from attnlab.console import printable
    from attnlab.training.config import ConfigError

    command = "python train.py " + " ".join(a for a in argv if a != "--dry-run")
    if given is not None and list(given) != list(argv):
        typed = "python train.py " + " ".join(a for a in given if a != "--dry-run")
        command = f"{typed.strip()} (expanded: {' '.join(a for a in argv if a not in given)})"
    try:
        plan = plan_command(argv, log=lambda m: print(m, file=sys.stderr, flush=True))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_plan(plan, command.strip())
    if plan.jobs and all(j.error for j in plan.jobs):
        if len(plan.jobs) == 1:  # (the line the command itself would print)
            print(f"error: {printable(plan.jobs[0].error)}", file=sys.stderr)
        return 2
    return 0
