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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

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
        """The whole command: Python's start, then the jobs, ``parallel`` at a time (their sum divided: the
        estimate of a machine whose cores the jobs share evenly); a representative counts as the jobs it stands
        for."""
        return START_S + sum((j.seconds or 0.0) * j.weight for j in self.jobs) / max(1, self.parallel)

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
                raise ConfigError(f"the sweep cannot be planned: {' '.join(str(exc).split())}") from None
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
            plan.parallel = _parallel(root)
        plan.threads = _threads(task_args, plan.parallel)
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
    return plan


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
            f"{', '.join(swept)} at their defaults, and that fails: {' '.join(str(exc).split())}; run one sweep per "
            f"value of the swept group (or sweep the fixed key too)"
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
    torch.set_num_threads(plan.threads)  # (the jobs' own count: timed as they will run, keyed by it in the cache)
    try:
        _cost_jobs(plan, fresh, log, folders)
    finally:
        torch.set_num_threads(threads_before)


_OUTCOME = ("steps", "batch_size", "seq_len", "flops_per_step", "step_s", "seconds", "error", "note")


def _cost_jobs(plan: Plan, fresh: bool, log: Callable[[str], None], folders: _FolderSpec | None) -> None:
    from attnlab.training.config import ConfigError

    cache = _Cache.load()
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
            cfg, datamodule, module, folder = _build(job.overrides, spec)
            from_step = _inspect_folder(cfg, folder, job) if folder is not None else 0
        except ConfigError as exc:
            job.error = str(exc)
            continue
        except Exception as exc:  # a job the sweep would see fail: say so, plan the others
            job.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
            continue
        job.steps, job.batch_size, job.seq_len = int(cfg.max_steps), datamodule.batch_size, datamodule.seq_len
        if from_step is None:  # a complete run asked to resume: the command changes nothing
            job.seconds = 0.0
            continue
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


def _build(
    overrides: Sequence[str], folder: tuple[list[str], int | None] | None = None
) -> tuple[DictConfig, Any, Any, Path | None]:
    """A job's config, checked as the run checks it before writing anything (:class:`ConfigError` in one line),
    its datamodule, its model, and, with ``folder`` (Hydra's overrides and the job's number: :func:`_job_folder`),
    its run folder where it exists (composed once: the config is the same as without Hydra's node, as
    :func:`hydra.compose` makes it)."""
    from omegaconf import open_dict

    from attnlab.training.config import (
        build_module,
        check_resolves,
        import_user_modules,
        resolve_match,
        validate_config,
    )

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
    with _quiet():
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
    estimated = [j for j in plan.jobs if j.seconds is not None]
    total = plan.seconds
    of = (
        f"{len(estimated)} of the {len(plan.jobs)} representative jobs estimated, each standing for its share of "
        f"the {plan.total:,}"
        if plan.sampled
        else f"{len(estimated)} of {len(plan.jobs)} jobs estimated"
    )
    console.print(
        f"estimated: {minutes(total)} in all ({total / 60:.1f} min, {_at_once(plan.parallel)}; {of}), "
        f"{plan.threads} thread(s) a job · step times: {plan.timed_models} model(s) timed now, {plan.cached_models} "
        f"from the cache ({plan.timing_s:.1f} s)"
    )
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


def _at_once(parallel: int) -> str:
    return "one job at a time" if parallel <= 1 else f"{parallel} jobs at a time"


def dry_run(argv: list[str]) -> int:
    """``python train.py ... --dry-run``: print the plan; exit code 0, or 2 when every job would be refused."""
    from attnlab.console import printable
    from attnlab.training.config import ConfigError

    command = "python train.py " + " ".join(a for a in argv if a != "--dry-run")
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
