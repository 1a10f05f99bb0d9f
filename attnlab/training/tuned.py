"""The tuned sweeper: every configuration of a sweep at its own best settings, then on several seeds.

    python train.py -m hydra/sweeper=tuned variant=scaled_dot,additive,linear

A shared learning rate makes a comparison a statement about that learning rate (Narang et al. 2021: most
Transformer modifications do not transfer once re-tuned). The protocol, after MAD (Poli et al. 2024) and Zoology
(Arora et al. 2023), with seed intervals at the tuned point added:

1. **tune**: each configuration (a point of the command line's sweep) runs every point of ``grid`` (default
   ``lr: [1e-3, 3e-3, 1e-2]``; weight decay and any other key may be added) on ``tune_seed``. The best point is the
   one with the best ``metric`` (default ``optimized_metric``, ``val/acc_best``; ``direction`` maximize or
   minimize) read from each job's summary.json. A job that failed, or whose metric is missing or not finite, ranks
   last, never first; ties go to the first point in grid order.
2. **seeds**: each configuration runs at its best point on every seed of ``seeds`` (default 1, 2, 3: not the tuning
   seed, so that the comparison's runs were not selected on their own validation metric). A seed equal to
   ``tune_seed`` reuses the tuning run instead of running it again. The comparison is then made on these runs'
   test metric (``python -m attnlab.dashboard <sweep>`` reads the sweep this way).

Every setting is checked before any job starts or anything is written (one ``error:`` line, exit code 2): the
grid, the seeds, the metric (one a run reports), and one composed job config of each configuration at each grid
point (and at each seed), by the run's own validation (:meth:`attnlab.training.lifecycle.Run.validate`). Between
the stages each configuration's chosen point is printed, flagged when it lies at the grid's edge (a numeric key with
at least two values, chosen at its smallest or largest: the best may lie beyond; ``edge`` in tuned.json). A sweep in
which a configuration has no chosen point (every grid point failed) or no seed run that finished ok exits 1.

The sweep folder holds ``tune/<n>_<overrides>`` and ``seeds/<n>_<overrides>`` run folders and ``tuned.json`` (the
plan, every grid point's value and status, each configuration's best point and its seed runs), rewritten after
each stage. While a sweep runs, it holds the folder's lock (:meth:`attnlab.runs.RunFolder.lock`: ``.attnlab.lock``
and the holder's pid, host and start time beside it): a second sweep into the same folder is refused in one line
naming the holder (a lock left by a process that has died is free again). A tuned sweep started again with the
same command and ``hydra.sweep.dir=<its folder>`` resumes: a job whose folder holds a finished run is not run again
(a failed one neither: it ranks last as before), and one that was interrupted continues from its last checkpoint
(``resume=true``). A job that failed for a reason of the machine, not of its settings (the disk full, ``ENOSPC``;
out of memory; killed by a signal: :func:`infra_failure`), or that was interrupted, is not ranked: its
configuration gets no chosen point yet, the sweep exits 1, and a resume runs the job again. The jobs go through the
configured launcher (local, joblib, SLURM), a stage at a time.

Hydra finds the sweeper through the shim in ``hydra_plugins/attnlab_tuned_sweeper`` (Hydra instantiates sweepers
only from its ``hydra_plugins`` package); the config is ``conf/hydra/sweeper/tuned.yaml``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = [
    "DEFAULT_GRID",
    "KNOWN_METRICS",
    "TUNED_FILE",
    "TunedError",
    "TunedSweeper",
    "grid_points",
    "infra_failure",
    "plan_count",
    "rank_value",
    "read_plan",
]

log = logging.getLogger(__name__)

TUNED_FILE = "tuned.json"
FORMAT = 1
DEFAULT_GRID: dict[str, list[Any]] = {"lr": [1e-3, 3e-3, 1e-2]}
_SAFE = re.compile(r"[^A-Za-z0-9._=+,:@-]")
KNOWN_METRICS = (
    "val/acc_best",
    "val/acc",
    "val/loss",
    "val/bpc",
    "test/acc",
    "test/loss",
    "test/bpc",
    "train/loss",
    "train/acc",
    "train/plateau_steps",
    "train/steps_to_99",
)
"""The metrics a run's summary.json reports (:mod:`attnlab.module`; ``val/bpc`` and ``test/bpc`` on a text task),
besides the patterns of :data:`_METRIC_PATTERN`."""
_METRIC_PATTERN = re.compile(r"test/(acc|loss|bpc)@\d+|attn/\S+|prune/auc_\S+")
_METRICS_SHOWN = ", ".join(KNOWN_METRICS) + ", test/acc@<length>, attn/<diagnostic>, prune/auc_<order>"
_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class TunedError(ValueError):
    """A tuned sweep that cannot be planned (one line)."""


def _container(value: Any) -> Any:
    """An OmegaConf node as plain Python (anything else as it is)."""
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value


def _as_list(value: Any, key: str) -> list[Any]:
    if isinstance(value, ListConfig | list | tuple):
        values = list(OmegaConf.to_container(value) if isinstance(value, ListConfig) else value)
    elif isinstance(value, str):
        values = [v.strip() for v in value.split(",") if v.strip()]
    else:
        values = [value]
    if not values:
        raise TunedError(f"hydra.sweeper.grid.{key} is empty: give at least one value")
    return values


def _text(value: Any) -> str:
    """A value as an override writes it (``0.001``, ``null``, ``true``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return format(value, "g")
    return str(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def grid_points(grid: dict[str, Any]) -> list[dict[str, Any]]:
    """The grid's points, the first key varying slowest: ``{lr: [a, b], wd: [0, 1]}`` → ``[{lr: a, wd: 0}, ...]``."""
    keys = list(grid)
    values = [_as_list(grid[k], k) for k in keys]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


def rank_value(value: Any, direction: str) -> float:
    """A job's metric as a number to maximise: a missing or non-finite value (a failed job) is -inf, so it ranks
    last in either direction."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return -math.inf
    if not math.isfinite(x):
        return -math.inf
    return x if direction == "maximize" else -x


def infra_failure(status: Any, reason: Any) -> str | None:
    """Why a failed job failed when the machine, not its settings, is to blame: ``"disk full (ENOSPC)"``, ``"out of
    memory"`` or ``"killed by a signal"``, read from its summary's ``reason`` (the run records the exception's type
    and text: ``OSError: [Errno 28] No space left on device``); None for any other failure and for a job that did not
    fail. Such a job is not ranked: a resume runs it again."""
    if status != "failed" or not isinstance(reason, str):
        return None
    text = reason.lower()
    if "enospc" in text or "errno 28" in text or "no space left on device" in text or "disk quota" in text:
        return "disk full (ENOSPC)"
    if "out of memory" in text or "outofmemoryerror" in text or re.search(r"\bmemoryerror\b", text):
        return "out of memory"
    if re.search(r"\bsig(kill|term|int|bus|segv|abrt)\b|killed by signal|\bkilled\b", text):
        return "killed by a signal"
    return None


def _folder_name(stage: str, num: int, overrides: Sequence[str]) -> str:
    """``tune/3_lr=0.001,variant=dot``: the stage, the job number, and the overrides made safe for a folder name and
    for Hydra's override grammar (quoted; no quote, ``$`` or backslash inside)."""
    from attnlab.training.config import job_dir_name

    name = _SAFE.sub("_", job_dir_name(",".join(sorted(overrides)), limit=150))
    return f"{stage}/{num}_{name}"


def read_plan(sweep_dir: str | Path, problems: list[str] | None = None) -> dict[str, Any] | None:
    """``tuned.json`` of a sweep folder (None when it has none or it cannot be read as a JSON object: never through a
    link, and a file nested too deeply for the parser is one problem, not a RecursionError). With ``problems``, why
    an existing file was not read is appended to it (one line)."""
    from attnlab.runs import RunFileError, read_text

    path = Path(sweep_dir) / TUNED_FILE
    try:
        data = json.loads(read_text(path))
    except RunFileError as exc:
        if problems is not None and (path.exists() or path.is_symlink()):
            problems.append(str(exc))
        return None
    except RecursionError:
        if problems is not None:
            problems.append(f"{path} is nested too deeply to be read")
        return None
    except ValueError as exc:
        if problems is not None:
            problems.append(f"{path} is not valid JSON ({' '.join(str(exc).split())[:120]})")
        return None
    if not isinstance(data, dict):
        if problems is not None:
            problems.append(f"{path} is not a JSON object")
        return None
    return data


def _job_status(sweep_dir: Path, job: str) -> tuple[str | None, dict[str, Any]]:
    """(status, metrics) of the run in ``sweep_dir/job``: (None, {}) when there is none."""
    status, metrics, _ = _job_record(sweep_dir, job)
    return status, metrics


def _seed_summary(sweep_dir: Path, job: str) -> Any:
    """The summary of the finished run in ``sweep_dir/job``; None for none, or one that did not finish ok."""
    from attnlab.runs import RunFileError, RunFolder

    try:
        summary = RunFolder(sweep_dir / job).read_summary(problems=[])
    except (RunFileError, OSError):
        return None
    return summary if summary is not None and summary.status == "ok" else None


def _job_record(sweep_dir: Path, job: str) -> tuple[str | None, dict[str, Any], str | None]:
    """(status, metrics, reason) of the run in ``sweep_dir/job``: (None, {}, None) when there is none."""
    from attnlab.runs import RunFileError, RunFolder

    try:
        summary = RunFolder(sweep_dir / job).read_summary(problems=[])
    except (RunFileError, OSError) as exc:
        return "failed", {}, str(exc)
    if summary is None:
        return None, {}, None
    return summary.status, dict(summary.metrics), summary.reason


def plan_count(config: DictConfig) -> int | None:
    """How many jobs a tuned sweep will launch (for the "job k/N" lines): grid × configurations plus the seed
    runs, less those whose folders already hold a finished or failed run.

    The sweep's report calls this when the multirun starts, before it writes anything into the sweep folder: so the
    whole plan is checked here first (:meth:`TunedSweeper.prepare`: one ``error:`` line and exit code 2 for a bad
    setting, or for a sweep folder another sweep holds), and the folder's lock is taken."""
    sweeper = _prepare_from(config)
    try:
        configs = sweeper._configurations(list(config.hydra.overrides.task))
        sweep_dir = Path(str(config.hydra.sweep.dir))
        points = grid_points(sweeper.grid)
        total = 0
        for i, overrides in enumerate(configs):
            for j, point in enumerate(points):
                job = sweeper._tune_job(i, j, overrides, point, len(points))
                status, _, reason = _job_record(sweep_dir, job[1])
                total += status in (None, "running", "interrupted") or infra_failure(status, reason) is not None
        return total + len(configs) * len([s for s in sweeper.seeds if s != sweeper.tune_seed])
    except Exception:  # the count is a courtesy
        return None


def _grid_given(config: DictConfig | None) -> tuple[Any] | None:
    """``(grid,)`` as the last ``hydra.sweeper.grid=<value>`` of the command line gives it whole (``{}`` included),
    or None when none does (then the composed grid: the default, with any ``hydra.sweeper.grid.<key>=`` merged)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = None
    for text in OmegaConf.select(config, "hydra.overrides.hydra", default=None) or [] if config is not None else []:
        if not str(text).lstrip("+~").startswith("hydra.sweeper.grid="):
            continue
        try:
            (override,) = OverridesParser.create().parse_overrides([str(text)])
        except Exception:  # (Hydra has parsed it once already)
            continue
        if not override.is_delete():
            given = (_container(override.value()),)
    return given


def _prepare_from(config: DictConfig) -> TunedSweeper:
    """A sweeper built from ``config.hydra.sweeper``, its plan checked and the sweep folder locked (exit 2 with one
    line otherwise)."""
    settings = {k: v for k, v in config.hydra.sweeper.items() if k != "_target_"}
    try:
        sweeper = TunedSweeper(**settings)
    except TypeError as exc:
        print(f"error: hydra.sweeper: {' '.join(str(exc).split())}", file=sys.stderr)
        raise SystemExit(2) from None
    sweeper.config = config
    sweeper.prepare()
    return sweeper


# the sweep folders this process holds the lock of (absolute path → the open lock)
_LOCKS: dict[str, contextlib.ExitStack] = {}


def _lock_sweep(sweep_dir: Path) -> None:
    """Take the sweep folder's lock for this process (:meth:`attnlab.runs.RunFolder.lock`): :class:`TunedError`
    naming the holder when another process has it. Held until :func:`_unlock_sweep` or the process ends."""
    from attnlab.runs import HOLDER_FILE, RunFileError, RunFolder, RunFolderBusy

    key = str(sweep_dir.absolute())
    if key in _LOCKS:
        return
    stack = contextlib.ExitStack()
    command = " ".join(["train.py", "-m", *(a for a in sys.argv[1:] if a != "-m")])
    try:
        stack.enter_context(RunFolder(sweep_dir).lock(command))
    except RunFolderBusy:
        raise TunedError(
            f"the sweep folder {sweep_dir} is in use by another sweep ({_holder(sweep_dir / HOLDER_FILE)}): wait "
            "for it to end, or use another hydra.sweep.dir"
        ) from None
    except (RunFileError, OSError) as exc:
        raise TunedError(f"the sweep folder {sweep_dir} cannot be locked: {' '.join(str(exc).split())}") from None
    _LOCKS[key] = stack


def _holder(path: Path) -> str:
    """``pid 123 on host since 2025-01-01T00:00:00+00:00 (command)`` from the lock's holder file."""
    from attnlab.runs import RunFileError, read_text

    try:
        info = json.loads(read_text(path))
        text = f"pid {int(info['pid'])} on {info['host']} since {info['since']}"
        return text + (f" ({info['command']})" if info.get("command") else "")
    except (RunFileError, ValueError, KeyError, TypeError, RecursionError):
        return "another process"


def _unlock_sweep(sweep_dir: Path) -> None:
    stack = _LOCKS.pop(str(sweep_dir.absolute()), None)
    if stack is not None:
        stack.close()


class _TunedEnd(Callback):
    """Runs last when the multirun ends (after the sweep's report): lets the sweep folder's lock go, and exits 1
    with one line per configuration that has no chosen point or no seed run that finished ok."""

    def __init__(self, sweep_dir: Path) -> None:
        self.sweep_dir = sweep_dir
        self.problems: list[str] = []

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from attnlab.console import printable

        _unlock_sweep(self.sweep_dir)
        if self.problems:
            for line in self.problems:
                print(f"tuned sweep: {printable(line)}", file=sys.stderr)
            raise SystemExit(1)


class TunedSweeper(Sweeper):
    """Hydra sweeper: tune each configuration on ``grid`` with ``tune_seed``, then run its best point on ``seeds``
    (see the module docstring). ``max_batch_size``: jobs handed to the launcher at once (None: a whole stage).

    The settings are kept as given; :meth:`validate` checks them and puts them in their plain form (``grid`` a dict
    of lists, ``seeds`` a list of ints)."""

    def __init__(
        self,
        grid: Any = None,
        seeds: Any = (1, 2, 3),
        tune_seed: Any = 0,
        metric: Any = None,
        direction: Any = "maximize",
        max_batch_size: Any = None,
        params: Any = None,
    ) -> None:
        super().__init__()
        grid = _container(grid)
        self.grid: Any = {k: list(v) for k, v in DEFAULT_GRID.items()} if grid is None else grid
        self.seeds: Any = list(seeds) if isinstance(seeds, tuple) else _container(seeds)
        self.tune_seed: Any = tune_seed
        self.metric: Any = metric
        self.direction: Any = str(direction)
        self.max_batch_size: Any = max_batch_size
        self.params: Any = _container(params) or {}
        self.config: DictConfig | None = None
        self.swept: set[str] = set()
        self.launcher: Any = None
        self.hydra_context: Any = None
        self.end: _TunedEnd | None = None

    # ------------------------------------------------------------------------------------------------ checks

    def validate(self) -> None:
        """:class:`TunedError` (one line) for settings that cannot be run; puts them in their plain form."""
        if self.direction not in ("maximize", "minimize"):
            raise TunedError(f"hydra.sweeper.direction={self.direction!r}: must be maximize or minimize")
        given = _grid_given(self.config)
        if given is not None:  # a grid given whole replaces the default (Hydra merges it into the default's keys)
            self.grid = given[0]
        self.grid = self._checked_grid(self.grid)
        self.seeds = self._checked_seeds(self.seeds)
        if not _is_int(self.tune_seed):
            raise TunedError(f"hydra.sweeper.tune_seed={self.tune_seed!r}: must be a whole number (a seed: 0, 1, ...)")
        size = self.max_batch_size
        if size is not None and (not _is_int(size) or size < 1):
            raise TunedError(
                f"hydra.sweeper.max_batch_size={size!r}: must be a whole number >= 1, or null (a whole stage at once)"
            )
        if self.metric is not None:
            self._check_metric(self.metric, "hydra.sweeper.metric")
        if not isinstance(self.params, dict):
            raise TunedError(f"hydra.sweeper.params={self.params!r}: must be a mapping of keys to values, or null")

    @staticmethod
    def _checked_grid(grid: Any) -> dict[str, list[Any]]:
        allowed = "give a mapping of config keys to lists of values: 'hydra.sweeper.grid={lr:[1e-3,1e-2]}'"
        if not isinstance(grid, dict):
            raise TunedError(f"hydra.sweeper.grid={grid!r} is not a mapping: {allowed}")
        if not grid:
            raise TunedError(f"hydra.sweeper.grid is empty: {allowed}")
        checked: dict[str, list[Any]] = {}
        for key, raw in grid.items():
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                raise TunedError(f"hydra.sweeper.grid: {key!r} is not a config key (a dotted name: lr, model.dropout)")
            if key == "seed":
                raise TunedError("hydra.sweeper.grid cannot tune seed: the seeds come from tune_seed and seeds")
            values = _as_list(raw, key)
            for value in values:
                if isinstance(value, dict | list):
                    raise TunedError(f"hydra.sweeper.grid.{key} holds {value!r}: each value must be a number or a word")
                if isinstance(value, float) and not math.isfinite(value):
                    raise TunedError(
                        f"hydra.sweeper.grid.{key} holds {value!r}: a grid value must be a finite number (or a word)"
                    )
            seen: list[Any] = []
            for value in values:
                if any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in seen):
                    raise TunedError(f"hydra.sweeper.grid.{key} lists {_text(value)} twice: give each value once")
                seen.append(value)
            checked[key] = values
        return checked

    @staticmethod
    def _checked_seeds(seeds: Any) -> list[int]:
        values = seeds if isinstance(seeds, list) else [seeds]
        if not values:
            raise TunedError("hydra.sweeper.seeds is empty: give at least one seed for the comparison ([1,2,3])")
        for seed in values:
            if not _is_int(seed):
                raise TunedError(
                    f"hydra.sweeper.seeds holds {seed!r}: seeds are whole numbers (hydra.sweeper.seeds=[1,2,3])"
                )
        if len(set(values)) < len(values):
            raise TunedError(f"hydra.sweeper.seeds={values}: a seed is listed twice: give each seed once")
        return list(values)

    @staticmethod
    def _check_metric(metric: Any, where: str) -> None:
        if not isinstance(metric, str) or not (metric in KNOWN_METRICS or _METRIC_PATTERN.fullmatch(metric)):
            raise TunedError(f"{where}={metric!r} is not a metric a run reports: one of {_METRICS_SHOWN}")

    def prepare(self) -> None:
        """Check everything before any job starts or anything is written, then lock the sweep folder; one
        ``error:`` line and exit code 2 otherwise. Settings (:meth:`validate`), the command line's configurations,
        the metric, then one composed job config of each configuration at each grid point on ``tune_seed``, and
        of the first configuration at the first point on each seed, by the run's own checks
        (:meth:`attnlab.training.lifecycle.Run.validate`). Done once per process and sweep folder."""
        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        if str(sweep_dir.absolute()) in _LOCKS:
            _one_line(self.validate)
            if self.metric is None:
                self.metric = str(self.config.get("optimized_metric") or "val/acc_best")
            return
        _one_line(self._check_all)
        _one_line(_lock_sweep, sweep_dir)

    def _check_all(self) -> None:
        assert self.config is not None
        self.validate()
        if self.metric is None:
            self.metric = self.config.get("optimized_metric") or "val/acc_best"
            self._check_metric(self.metric, "optimized_metric (the tuned sweeper's metric)")
        configs = self._configurations(list(self.config.hydra.overrides.task))
        points = grid_points(self.grid)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        for i, overrides in enumerate(configs):
            for j, point in enumerate(points):
                job, folder = self._tune_job(i, j, overrides, point, len(points))
                self._check_job(job, sweep_dir / folder, overrides, point)
        grid = [f"{k}={_text(v)}" for k, v in points[0].items()]
        for seed in self.seeds:
            if seed != self.tune_seed:
                self._check_job([*configs[0], *grid, f"seed={seed}"], sweep_dir, configs[0], points[0])

    def _check_job(self, overrides: list[str], folder: Path, configuration: list[str], point: dict[str, Any]) -> None:
        """Compose the job of ``overrides`` as the launcher will, and check it as the run will before it writes
        its folder: :class:`TunedError` naming the configuration and the grid point."""
        from hydra.core.global_hydra import GlobalHydra
        from hydra.errors import HydraException
        from omegaconf import open_dict, read_write
        from omegaconf.errors import OmegaConfBaseException

        from attnlab.training.config import ConfigError
        from attnlab.training.lifecycle import Run

        label = self._label(configuration) or "the base configuration"
        where = f"{label} with {', '.join(f'{k}={_text(v)}' for k, v in point.items())}"
        seed = next((o for o in overrides if o.startswith("seed=")), None)
        if seed is not None and seed != f"seed={self.tune_seed}":
            where += f" on {seed}"
        loader = (
            self.hydra_context.config_loader
            if self.hydra_context is not None
            else GlobalHydra.instance().config_loader()
        )
        try:
            cfg = loader.load_sweep_config(self.config, list(overrides))
            with read_write(cfg), open_dict(cfg):
                del cfg["hydra"]
            Run(cfg, folder).validate()
        except (HydraException, OmegaConfBaseException) as exc:
            text = " ".join(str(exc).split())
            raise TunedError(f"{where}: the job's config cannot be composed: {text}") from None
        except (ConfigError, ValueError, TypeError) as exc:
            raise TunedError(f"{where}: {' '.join(str(exc).split())}") from None
        except Exception as exc:  # (a check that broke: still one line, and no job started)
            text = " ".join(str(exc).split())
            raise TunedError(f"{where}: the job's config could not be checked ({type(exc).__name__}: {text})") from None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.prepare()
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        self.end = _TunedEnd(Path(str(config.hydra.sweep.dir)))
        callbacks = getattr(getattr(hydra_context, "callbacks", None), "callbacks", None)
        if isinstance(callbacks, list):  # first in the list: the last to hear that the multirun ended
            callbacks.insert(0, self.end)

    # ------------------------------------------------------------------------------------------------- planning

    def _configurations(self, arguments: list[str]) -> list[list[str]]:
        """The command line's sweep as one list of overrides per configuration (Hydra's basic sweeper's product)."""
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        given = [f"{k}={v}" for k, v in (self.params or {}).items()] + list(arguments)
        parsed = OverridesParser.create().parse_overrides(given)
        for override in parsed:
            key = override.get_key_element().lstrip("+~")
            if key == "seed":
                raise TunedError(
                    "a tuned sweep sets seed itself (tune_seed, then seeds): leave seed off the command line"
                )
            if key in self.grid:
                raise TunedError(
                    f"{key} is tuned (hydra.sweeper.grid.{key}), so it cannot also be given on the command line: "
                    f"set its values in the grid: 'hydra.sweeper.grid={{{key}:[...]}}'"
                )
        self.swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
        (configs,) = BasicSweeper.split_arguments(parsed, None)
        return configs

    def _named(self, overrides: Sequence[str]) -> list[str]:
        """The overrides that name a job's folder: not those Hydra leaves out of ``override_dirname``
        (``debug``, ``logger``, ... in conf/hydra/default.yaml)."""
        excluded = set(OmegaConf.select(self.config, "hydra.job.config.override_dirname.exclude_keys") or [])
        return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in excluded]

    def _label(self, overrides: Sequence[str]) -> str:
        """A configuration's name: its swept overrides (all of them when nothing is swept)."""
        swept = [o for o in overrides if o.split("=", 1)[0] in self.swept]
        return ",".join(swept or self._named(overrides))

    def _tune_job(
        self, i: int, j: int, overrides: list[str], point: dict[str, Any], n_points: int
    ) -> tuple[list[str], str]:
        grid = [f"{k}={_text(v)}" for k, v in point.items()]
        num = i * n_points + j
        return [*overrides, *grid, f"seed={self.tune_seed}"], _folder_name(
            "tune", num, self._named([*overrides, *grid])
        )

    # ---------------------------------------------------------------------------------------------------- sweep

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        self.prepare()  # (done already when the multirun started: then only the lock is checked to be held)
        try:
            return self._sweep(sweep_dir, arguments)
        finally:
            _unlock_sweep(sweep_dir)

    def _sweep(self, sweep_dir: Path, arguments: list[str]) -> Any:
        from attnlab.runs import write_json_atomic
        from attnlab.stats import grid_edges  # (one rule for the terminal, tuned.json and the page)
        from attnlab.training.multirun import signalled

        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        configs = _one_line(self._configurations, arguments)
        points = grid_points(self.grid)
        plan: dict[str, Any] = {
            "format": FORMAT,
            "metric": self.metric,
            "direction": self.direction,
            "grid": {k: _as_list(v, k) for k, v in self.grid.items()},
            "tune_seed": self.tune_seed,
            "seeds": self.seeds,
            "stage": "tune",
            "configurations": [],
        }
        tune_jobs: list[tuple[list[str], str]] = []
        for i, overrides in enumerate(configs):
            entry: dict[str, Any] = {"overrides": overrides, "label": self._label(overrides), "tune": [], "best": None}
            for j, point in enumerate(points):
                job = self._tune_job(i, j, overrides, point, len(points))
                tune_jobs.append(job)
                entry["tune"].append({"point": point, "job": job[1], "status": None, "value": None})
            plan["configurations"].append(entry)
        write_json_atomic(sweep_dir / TUNED_FILE, plan)
        returns = [self._launch(sweep_dir, tune_jobs, 0)]
        problems: list[str] = []

        # the best point of each configuration, from the summaries the jobs wrote
        seed_jobs: list[tuple[list[str], str]] = []
        num = len(tune_jobs)
        for entry in plan["configurations"]:
            pending = []
            for item in entry["tune"]:
                status, metrics, reason = _job_record(sweep_dir, item["job"])
                item["status"], item["value"] = status, metrics.get(self.metric)
                infra = infra_failure(status, reason)
                if infra is not None:
                    item["infra"], item["reason"] = infra, reason
                    pending.append(f"{item['job']} failed: {infra}")
                elif status != "ok" and status != "failed":
                    pending.append(f"{item['job']} is {status or 'not run'}")
                elif status == "failed":
                    item["reason"] = reason
            ranked = [
                rank_value(item["value"] if item["status"] == "ok" else None, self.direction) for item in entry["tune"]
            ]
            best = max(range(len(ranked)), key=lambda k: (ranked[k], -k))
            entry["best"] = entry["tune"][best]["point"] if math.isfinite(ranked[best]) and not pending else None
            entry["edge"] = grid_edges(plan["grid"], entry["best"])  # (the page's rule, read from tuned.json)
            entry["seeds"] = []
            if pending:
                entry["pending"] = pending
                problems.append(
                    f"{entry['label'] or '(base)'}: no point chosen yet: {'; '.join(pending)} (not ranked: start the "
                    "sweep again with the same command and hydra.sweep.dir to run it again)"
                )
                continue
            if entry["best"] is None:
                problems.append(f"{entry['label'] or '(base)'}: every grid point failed; its seeds were not run")
                continue
            grid = [f"{k}={_text(v)}" for k, v in entry["best"].items()]
            for seed in self.seeds:
                if seed == self.tune_seed:
                    entry["seeds"].append({"seed": seed, "job": entry["tune"][best]["job"], "reused": True})
                    continue
                overrides = [*entry["overrides"], *grid, f"seed={seed}"]
                job = _folder_name("seeds", num, self._named([*entry["overrides"], *grid, f"seed={seed}"]))
                num += 1
                seed_jobs.append((overrides, job))
                entry["seeds"].append({"seed": seed, "job": job})
        _print_chosen(plan)
        plan["stage"] = "seeds"
        write_json_atomic(sweep_dir / TUNED_FILE, plan)
        if signalled():  # Ctrl-C or SIGTERM during the tuning stage: no seed run starts
            return returns
        returns.append(self._launch(sweep_dir, seed_jobs, len(tune_jobs)))
        for entry in plan["configurations"]:
            for item in entry.get("seeds", []):
                item["status"] = _job_status(sweep_dir, item["job"])[0]
            if entry["best"] is not None and not any(item["status"] == "ok" for item in entry["seeds"]):
                problems.append(f"{entry['label'] or '(base)'}: no seed run finished ok")
        plan["stage"] = "done"
        write_json_atomic(sweep_dir / TUNED_FILE, plan)
        if self.end is not None:
            self.end.problems = problems
        _print_plan(plan, sweep_dir)
        return returns

    def _launch(self, sweep_dir: Path, jobs: list[tuple[list[str], str]], first: int) -> list[Any]:
        """Launch the jobs whose folders hold no finished or failed run (an interrupted one resumes; one that
        failed for a reason of the machine, :func:`infra_failure`, runs again), in batches of ``max_batch_size``; a
        job's number is its place in the plan."""
        from attnlab.console import plain_console
        from attnlab.runs import RunFolder
        from attnlab.training.multirun import signalled

        console = plain_console()
        todo: list[tuple[int, list[str]]] = []
        for k, (overrides, job) in enumerate(jobs):
            status, _, reason = _job_record(sweep_dir, job)
            if status == "ok" or (status == "failed" and infra_failure(status, reason) is None):
                continue
            if status == "failed":  # (a run that started continues from its checkpoint; one refused is replaced)
                extra = ["resume=true"] if RunFolder(sweep_dir / job).config_path.exists() else ["overwrite=true"]
                console.print(f"tuned: {job}: failed: {infra_failure(status, reason)}: running it again ({reason})")
            else:
                extra = ["resume=true"] if status is not None else []
            todo.append((first + k, [*overrides, *extra, f"hydra.sweep.subdir='{job}'"]))
        results: list[Any] = []
        size = self.max_batch_size or len(todo) or 1
        for start in range(0, len(todo), size):
            if signalled():
                break
            batch = todo[start : start + size]
            # (a launcher numbers a batch's jobs from its first index on; the folder names carry the plan's numbers)
            results.extend(self.launcher.launch([o for _, o in batch], initial_job_idx=batch[0][0]))
        return results


def _one_line(function: Any, *args: Any) -> Any:
    """``function(*args)``; a :class:`TunedError` ends the sweep with one line and exit code 2, before any job."""
    from attnlab.console import printable

    try:
        return function(*args)
    except TunedError as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        raise SystemExit(2) from None


def _print_chosen(plan: dict[str, Any]) -> None:
    """Between the stages: one line per configuration with its chosen point (and its tuning value), flagged when it
    lies at the grid's edge."""
    from attnlab.console import plain_console

    console = plain_console()
    for entry in plan["configurations"]:
        label = entry["label"] or "(base)"
        best = entry.get("best")
        if best is None:
            why = "not chosen yet (see below)" if entry.get("pending") else "every grid point failed"
            console.print(f"tuned: {label}: {why}")
            continue
        value = next((t["value"] for t in entry["tune"] if t["point"] == best), None)
        line = f"tuned: {label}: chose {', '.join(f'{k}={_text(v)}' for k, v in best.items())}"
        if _is_number(value):
            line += f" ({plan['metric']} {value:.4g})"
        if entry.get("edge"):
            where = ", ".join(
                f"{k}={_text(best[k])} is the grid's {'smallest' if best[k] == min(plan['grid'][k]) else 'largest'}"
                for k in entry["edge"]
            )
            line += f"; at the grid's edge: widen it ({where})"
        console.print(line)


def _print_plan(plan: dict[str, Any], sweep_dir: Path) -> None:
    """The tuned sweep's outcome: each configuration's best point, its tuning value and its seeds' test accuracy."""
    from rich.table import Table

    from attnlab.console import plain_console
    from attnlab.stats import interval_text, mean_ci  # (as the dashboard prints them: training never imports it)

    table = Table(
        title=f"tuned sweep {sweep_dir}: best {plan['metric']} on seed {plan['tune_seed']}", title_justify="left"
    )
    seeds = {
        e["label"]: [_seed_summary(sweep_dir, s["job"]) for s in e.get("seeds", [])] for e in plan["configurations"]
    }
    # the tasks' headline metric (summary.json headline_metric: test/acc@128 for a state-tracking task), else test/acc
    headlines = {m.headline_metric for runs in seeds.values() for m in runs if m is not None and m.headline_metric}
    headline = headlines.pop() if len(headlines) == 1 else "test/acc"
    shown_name = headline.removeprefix("test/").replace("acc", "test acc", 1).replace("bpc", "test bpc", 1)
    star = "★ " if headline != "test/acc" else ""
    for col in ("configuration", "best", plan["metric"], f"{star}{shown_name} (seeds)"):  # (text folds; never cut)
        table.add_column(col, justify="left" if col in ("configuration", "best") else "right", overflow="fold")
    for entry in plan["configurations"]:
        best = entry.get("best")
        value = next((t["value"] for t in entry["tune"] if t["point"] == best), None) if best else None
        runs = [m for m in seeds[entry["label"]] if m is not None]
        tests = [m.metrics.get(headline) for m in runs]
        mean, half, n = mean_ci(tests)
        shown = "-" if n == 0 else interval_text(mean, half, headline, n)  # (as the page prints it)
        models = {m.model for m in runs if m.model}
        chosen = ", ".join(f"{k}={_text(v)}" for k, v in best.items()) if best else None
        if chosen is None:
            chosen = "not chosen yet" if entry.get("pending") else "all failed"
        elif entry.get("edge"):
            chosen += " (grid's edge)"
        label = entry["label"] or "(base)"
        if len(models) == 1 and label.startswith("compare="):  # a comparison's model, as the run recorded it
            label = f"model={models.pop()}{label[label.find(',') :] if ',' in label else ''}"
        table.add_row(
            label,
            chosen,
            f"{value:.4g}" if _is_number(value) else "-",
            shown,
        )
    plain_console().print(table)
