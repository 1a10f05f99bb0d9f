"""Plain helpers shared by the test files (fixtures live in conftest.py, which imports this module first).

- The built-in names, read from attnlab's registries when this module is first imported (conftest imports it
  before any test module, so names a test registers for itself are never among them), and ONE table of the
  parameters each built-in is tested with: a name the table does not know is tested with no parameters, so a new
  built-in is covered without editing a test list.
- Tensors and modules: :func:`grid` (a bool mask from a predicate), :func:`conv_loop` (a short convolution as a
  loop), :func:`randomize_`, :func:`make_mha`.
- Runs: :func:`compose_cfg`, :func:`train_task` and :func:`train_listops` (an in-process ``debug=fast`` run),
  :func:`setting_overrides` (a form setting's command line), :func:`small` (a small task), :func:`train_env` and
  :func:`run_train` (a real ``python train.py``), :func:`run_cli` (the same command line in this process, for what a
  command prints and leaves on disk), :func:`read_summary`, :func:`run_folders`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import attnlab

REPO = Path(__file__).resolve().parents[1]
TRAIN_PY = REPO / "train.py"
SUBPROCESS_TIMEOUT = 300

# ---------------------------------------------------------------------------------------------- the built-ins

# The decay and delta-rule forms (attnlab.forms: retnet, gla, deltanet, gated_deltanet, kda, and any registered later)
# are forms, chosen by variant=<name>: tests/test_recurrences.py tests every one of them, from the registry's tags.
import attnlab.forms  # noqa: E402

RECURRENT_FORMS: tuple[str, ...] = tuple(
    n for n in attnlab.forms.list_forms() if {"decay", "delta"} & attnlab.forms.form_class(n).tags
)
# Every form with an O(L) form and a fixed-size state (tag ``recurrent``: linear attention and the forms above), at
# its defaults and at each of its named settings (attnlab.forms.form_settings: gla, gla_channel, gla_mamba2, ...,
# kda, kda_beta2): FormSetting(label, form, params), the params being the form's ``variant.params``
# (``AttentionConfig.score_params``).
RECURRENT_SETTINGS: tuple[attnlab.forms.FormSetting, ...] = tuple(attnlab.forms.form_settings("recurrent"))
SCORES: tuple[str, ...] = tuple(n for n in attnlab.list_scores() if n not in RECURRENT_FORMS)
POSITION_BIASES: tuple[str, ...] = tuple(attnlab.list_position_biases())
MASKS: tuple[str, ...] = tuple(attnlab.list_masks())
NORMALIZERS: tuple[str, ...] = tuple(attnlab.list_normalizers())
LINEAR_NORMALIZERS: tuple[str, ...] = tuple(
    n for n in NORMALIZERS if getattr(attnlab.build_normalizer(n, num_heads=1), "is_linear", False)
)

T5_PARAMS = {"num_buckets": 8, "max_distance": 16}
WINDOW_2 = {"name": "sliding_window", "window": 2}

# The parameters each built-in is built with in the tests (beside d_k / num_heads), chosen so that the small
# sequences of the tests (L = 5..7) reach clipping and T5's log buckets. Not listed: built with no parameters.
TEST_PARAMS: dict[str, dict[str, dict[str, Any]]] = {
    "score": {
        "additive": {"d_attn": 3},
        "relative_position": {"clip": 2},
        "t5_bias": T5_PARAMS,
    },
    "position_bias": {
        "shaw": {"clip": 2},
        "t5": T5_PARAMS,
    },
    "mask": {
        "sliding_window": {"window": 2},
        "and": {"masks": ["causal", WINDOW_2]},
        "or": {"masks": ["causal", WINDOW_2]},
    },
    "normalizer": {},
}


def params_of(kind: str, name: str) -> dict[str, Any]:
    """The test parameters of built-in ``name`` of ``kind`` (score, position_bias, mask, normalizer); a copy."""
    return copy.deepcopy(TEST_PARAMS[kind].get(name, {}))


def score_cases() -> list[tuple[str, str, dict[str, Any]]]:
    """(id, name, params) for every built-in score, with its test parameters."""
    return [(name, name, params_of("score", name)) for name in SCORES]


def mask_cases() -> list[tuple[str, dict[str, Any]]]:
    """(name, params) for every built-in mask, with its test parameters."""
    return [(name, params_of("mask", name)) for name in MASKS]


# ---------------------------------------------------------------------------------------------- tensors and modules


def grid(lq: int, lk: int, pred) -> torch.Tensor:
    """(lq, lk) bool tensor: ``pred(i, j)`` for query i and key j."""
    return torch.tensor([[bool(pred(i, j)) for j in range(lk)] for i in range(lq)])


def conv_loop(x, weight):
    """A short convolution written out: y_t = Σ_{s<k} w[c, 0, k−1−s]·x_{t−s} per channel c (zeros before the start);
    x (B, L, C), weight (C, 1, k)."""
    Bn, Ln, C = x.shape
    width = weight.shape[-1]
    rows = []
    for t in range(Ln):
        acc = torch.zeros(Bn, C, dtype=x.dtype)
        for s in range(width):
            if t - s >= 0:
                acc = acc + weight[:, 0, width - 1 - s] * x[:, t - s]
        rows.append(acc)
    return torch.stack(rows, dim=1)


def randomize_(module, seed=0, scale=1.0):
    """Overwrite every parameter of ``module`` with N(0, scale^2) noise: no term hides behind a zero init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return module


def make_mha(
    d_model: int,
    num_heads: int,
    d_k: int,
    d_v: int | None = None,
    *,
    seed: int = 0,
    train: bool = False,
    **options: Any,
) -> attnlab.MultiHeadAttention:
    """A float64 MultiHeadAttention (eval mode unless ``train``) with every parameter drawn from N(0, 0.5²)."""
    mha = attnlab.MultiHeadAttention(d_model, num_heads, d_k, d_v=d_v, **options).double().train(train)
    return randomize_(mha, seed, scale=0.5)


# ---------------------------------------------------------------------------------------------- runs


@contextlib.contextmanager
def registered_here(*modules: str):
    """The forms registered inside the block (a user's module imported by a run, a class a test registers) are
    taken out of the registry afterwards, and ``modules`` out of ``sys.modules``, so the next test sees the
    built-ins alone."""
    before = attnlab.forms.list_forms()
    try:
        yield
    finally:
        for name in [n for n in attnlab.forms.list_forms() if n not in before]:
            attnlab.forms._FORMS._entries.pop(name, None)
            attnlab.forms._ORDER.remove(name)
        for module in modules:
            sys.modules.pop(module, None)


def compose_cfg(*overrides: str, hydra_cfg: bool = False):
    """The config of ``conf/`` with ``overrides`` (inside the ``hydra_ctx`` fixture); ``hydra_cfg`` keeps the
    ``hydra`` node (without it: the job config as ``train.py`` receives it)."""
    from hydra import compose

    return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra_cfg)


def train_task(tmp_path: Path, task: str, *overrides: str) -> dict[str, Any]:
    """Train in this process (``attnlab.training.run``) on ``task`` with ``debug=fast``, no logger, d_model 16 and
    2 heads, plus ``overrides``, into ``tmp_path`` → its summary.json (use with the ``restore_process_state``
    fixture)."""
    from hydra import compose, initialize_config_dir

    from attnlab.training import CONF_DIR, run

    fixed = [f"task={task}", "debug=fast", "logger=none", "results_table=false", "d_model=16", "num_heads=2"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*fixed, *overrides])
    run(cfg, tmp_path)
    return read_summary(tmp_path)


def train_listops(tmp_path: Path, *overrides: str) -> dict[str, Any]:
    """:func:`train_task` on ListOps."""
    return train_task(tmp_path, "listops", *overrides)


def setting_overrides(setting: attnlab.forms.FormSetting) -> list[str]:
    """The command line of a :class:`~attnlab.forms.FormSetting`: ``variant=<form>`` and one
    ``variant.params.<key>=<value>`` per parameter of the setting (a form without a file in conf/variant is not
    a setting of the command line: use ``variant=custom variant.name=<form>``)."""
    return [f"variant={setting.form}", *(f"variant.params.{k}={v}" for k, v in setting.params.items())]


def small(name: str, sizes: dict[str, Any] | Callable[[str], dict[str, Any]] | None = None, **kwargs: Any):
    """Task ``name`` built with ``sizes`` (small splits and batches; or a function of the task's name giving them)
    and ``kwargs`` on top, set up. A test file binds its sizes once: ``small = functools.partial(helpers.small,
    sizes=SIZES)``."""
    from attnlab.tasks import build_task

    if callable(sizes):
        sizes = sizes(name)
    task = build_task(name, **{**(sizes or {}), **kwargs})
    task.setup()
    return task


def train_env(*, wandb: str | None = "offline", full_error: bool = False, **extra: str) -> dict[str, str]:
    """The environment for ``python train.py``: one thread, no inherited launch id (each launch draws its own), W&B
    in mode ``wandb`` (None: as the environment and the config say), tracebacks only with ``full_error``."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATTNLAB_UID", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.setdefault("ATTNLAB_SWEEP_ESTIMATE", "0")  # (a sweep's start-up estimate: tests/test_plan.py turns it on)
    if wandb is None:
        env.pop("WANDB_MODE", None)
    else:
        env["WANDB_MODE"] = wandb
    if full_error:
        env["HYDRA_FULL_ERROR"] = "1"
    env.update(extra)
    return env


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, str(TRAIN_PY), *args]


def run_train(
    *args: str,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    timeout: float = SUBPROCESS_TIMEOUT,
    returncode: int | None = None,
    wandb: str | None = "offline",
    full_error: bool = False,
    **extra_env: str,
) -> subprocess.CompletedProcess:
    """``python train.py *args`` in ``cwd``, with ``env`` (default: :func:`train_env` with ``wandb`` and
    ``full_error``) and ``extra_env`` on top; with ``returncode``, asserts that it exited with it."""
    proc = subprocess.run(
        train_cmd(*args),
        cwd=cwd,
        env={**(train_env(wandb=wandb, full_error=full_error) if env is None else env), **extra_env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if returncode is not None:
        assert proc.returncode == returncode, (
            f"train.py {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


# a fresh interpreter's warning filters (``python -W`` unset): what ``python train.py`` would print on stderr
_DEFAULT_WARNING_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""),
    ("ignore", ImportWarning, ""),
    ("ignore", ResourceWarning, ""),
)


def run_cli(
    *args: str,
    cwd: Path = REPO,
    wandb: str | None = "offline",
    returncode: int | None = None,
    **extra_env: str,
) -> subprocess.CompletedProcess:
    """``python train.py *args`` run in this process: :func:`attnlab.training.cli.main` with ``args``, in ``cwd``,
    with the environment of :func:`run_train` (and ``extra_env``); its exit code (SystemExit's), stdout and stderr
    as a CompletedProcess. For commands whose output and files are what a test checks (a refusal, a finished run
    saying so): the same code path as the real command without the 2-3 s of a fresh interpreter's imports. A
    warning that a fresh interpreter would print goes to stderr as it would there; an exception that would have been
    a traceback propagates. The process is left as it was: environment, working directory, ``sys.argv``, logging
    (Hydra configures it), Hydra's global state, attnlab's sweep state, torch's threads, the warning filters.

    Real subprocesses (:func:`run_train`) stay for what only a process shows: imports, signals, exit on a kill,
    Hydra's multirun launchers, Lightning's and W&B's own processes."""
    import torch
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from attnlab.training import cli, sweep

    environ, cwd_before, argv = dict(os.environ), os.getcwd(), list(sys.argv)
    threads, sweep_state = torch.get_num_threads(), copy.copy(sweep._state)
    hydra_before, hydra_cfg = GlobalHydra.instance().hydra, HydraConfig.instance().cfg
    manager = logging.Logger.manager
    loggers = {name: lg for name, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    saved = {lg: (lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in [logging.root, *loggers.values()]}
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    try:
        os.environ.clear()
        os.environ.update({**train_env(wandb=wandb), **extra_env})
        os.chdir(cwd)
        GlobalHydra.instance().clear()  # (a module's hydra_ctx: main composes on its own)
        HydraConfig.instance().cfg = None
        sweep._state.update(created=(None, []), failed=0, sweep=None, signalled=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()
            for action, category, module in _DEFAULT_WARNING_FILTERS:
                warnings.filterwarnings(action, category=category, module=module)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    cli.main(list(args))
                except SystemExit as exc:
                    code = exc.code
        for w in caught:
            err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    finally:
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd_before)
        sys.argv[:] = argv
        torch.set_num_threads(threads)
        sweep._state.clear()
        sweep._state.update(sweep_state)
        GlobalHydra.instance().hydra = hydra_before
        HydraConfig.instance().cfg = hydra_cfg
        for lg, (handlers, level, propagate, disabled) in saved.items():
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
        for name, lg in manager.loggerDict.items():  # loggers made during the run: as a fresh logger is
            if isinstance(lg, logging.Logger) and name not in loggers:
                lg.handlers.clear()
                lg.setLevel(logging.NOTSET)
                lg.propagate, lg.disabled = True, False
    if code is None:
        code = 0
    elif not isinstance(code, int):  # SystemExit("text"): the text on stderr, exit code 1, as Python does
        err.write(f"{code}\n")
        code = 1
    proc = subprocess.CompletedProcess(["train.py", *args], code, out.getvalue(), err.getvalue())
    if returncode is not None:
        assert proc.returncode == returncode, (
            f"train.py {' '.join(args)} (in process) exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-5000:]}"
        )
    return proc


def read_summary(folder: Path) -> dict:
    """The summary.json of run folder ``folder``."""
    from attnlab.runs import SUMMARY_FILE

    folder = Path(folder)
    path = folder / SUMMARY_FILE
    if not path.is_file():
        found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "no such folder"
        raise AssertionError(f"no {SUMMARY_FILE} in {folder}: {found}")
    return json.loads(path.read_text())


def run_folders(sweep_dir: Path) -> list[Path]:
    """The job folders of a sweep (Hydra's own files, multirun.yaml and .hydra, are not job folders)."""
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
