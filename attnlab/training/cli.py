"""The command line: ``python train.py [overrides]`` and ``python train.py -m [sweep]`` (also ``attnlab-train``).

Before Hydra composes anything, the overrides are checked (an unknown group choice, a plugin that is not
installed, the SLURM launcher without a cluster: one line, exit 2), and ``resume=true hydra.run.dir=<run>``
gets the run's own overrides put in front of the command line's, so that a resume needs nothing but the folder.
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from attnlab.runs import RunFileError, RunFolder
from attnlab.training.config import CONF_DIR, ConfigError, check_group_choices

__all__ = ["check_keys", "check_plugins", "hydra_main", "main", "with_run_overrides"]

# command-line choices that need an optional Hydra plugin: (group, choice) -> (plugin module, extra)
_PLUGINS = {
    ("hparams_search", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
    ("hydra/sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
    **{
        ("hydra/launcher", name): ("hydra_plugins.hydra_submitit_launcher", "slurm")
        for name in ("slurm", "local", "submitit_slurm", "submitit_local")
    },
}
_SLURM_LAUNCHERS = ("slurm", "submitit_slurm")
# keys of a run's recorded overrides that a resume does not repeat
_NOT_REPEATED = ("resume", "ckpt_path", "overwrite")


def _split(arg: str) -> tuple[str, str]:
    """An override's key (without ``+``, ``++``, ``~`` or ``override``) and value."""
    key, _, value = arg.partition("=")
    return key.lstrip("+~").removeprefix("override ").strip(), value.strip()


def check_plugins(overrides: list[str]) -> None:
    """One line, not Hydra's composition error, when a choice needs a plugin that is not installed, or the SLURM
    launcher is asked for on a machine without SLURM."""
    for arg in overrides:
        key, value = _split(arg)
        plugin = _PLUGINS.get((key, value))
        if plugin is not None and importlib.util.find_spec(plugin[0]) is None:
            raise ConfigError(f"{key}={value} needs the {plugin[1]} extra: pip install -e '.[{plugin[1]}]'")
        if key == "hydra/launcher" and value in _SLURM_LAUNCHERS and shutil.which("srun") is None:
            raise ConfigError(
                f"hydra/launcher={value} needs a SLURM cluster, and this machine has none (no srun on PATH); "
                "to try the sweep here, use hydra/launcher=local"
            )


def check_keys(overrides: list[str]) -> None:
    """One line (with the closest key) for ``key=value`` whose key the config does not have, instead of Hydra's
    five-line "Could not override" message. The config is composed with the command line's group choices (the
    first of a sweep's); anything this check cannot judge is left to Hydra."""
    import difflib

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from attnlab.training.config import GROUPS

    choices, keys = [], []
    for arg in overrides:
        if "=" not in arg or arg.startswith(("-", "+", "~")) or arg.startswith("hydra"):
            continue
        key, value = _split(arg)
        if key in GROUPS or "/" in key:
            choices.append(f"{key}={value.split(',')[0]}")
        else:
            keys.append((key, arg))
    if not keys:
        return
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=choices)
    except Exception:  # a bad group choice is reported elsewhere, anything else by Hydra itself
        return
    known = _flat_keys(OmegaConf.to_container(cfg, resolve=False))
    for key, arg in keys:
        if key not in known and not any(k.startswith(key + ".") for k in known):
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{key}'{hint} (to add a key that the config lacks: +{arg})")


def _flat_keys(node: Any, prefix: str = "") -> set[str]:
    if not isinstance(node, dict):
        return {prefix.rstrip(".")}
    keys = {prefix.rstrip(".")} if prefix else set()
    for key, value in node.items():
        keys |= _flat_keys(value, f"{prefix}{key}.")
    return keys


def _names_code(override: str) -> bool:
    """Whether an override can make Hydra import or instantiate something (``imports``, a ``_target_`` in its key
    or value, or any ``hydra`` setting, such as a callback): a run folder's overrides of this kind are never
    re-applied by a resume."""
    key, value = _split(override)
    return key == "imports" or key.startswith("hydra") or any(m in key + value for m in _CODE_MARKERS)


_CODE_MARKERS = ("_target_", "_partial_", "_args_")


def with_run_overrides(argv: list[str]) -> list[str]:
    """For a single run with ``resume=true`` (or ``ckpt_path=last``) and ``hydra.run.dir=<folder>``: the
    overrides of the run's last start (kept in its summary), then the command line's (which win). A command line
    that repeats them is unchanged. Anything else is returned as is.

    The folder is data, never code: of its overrides only values are re-applied. ``imports`` and ``hydra.*`` are
    not (the run checks the folder's ``imports`` against the command line's before importing anything), and one
    that names code (``_target_``) is refused in one line unless the command line gives that key itself."""
    if "-m" in argv or "--multirun" in argv:
        return argv
    pairs = [_split(a) for a in argv if "=" in a]
    values = dict(pairs)
    if str(values.get("resume")).lower() != "true" and values.get("ckpt_path") != "last":
        return argv
    folder = values.get("hydra.run.dir")
    if folder is None:
        raise ConfigError("resume=true continues a run folder: name it with hydra.run.dir=<the run folder>")
    try:
        summary = RunFolder(folder.strip("'\"")).read_summary()
    except RunFileError:
        return argv  # the run itself reports the unreadable summary
    given = {key for key, _ in pairs}
    last = summary.segments[-1].overrides if summary and summary.segments else (summary.overrides if summary else [])
    stored = [o for o in last if "=" in o]  # the last start's: an extension's larger max_steps included
    kept = [o for o in stored if _split(o)[0] not in given and _split(o)[0] not in _NOT_REPEATED]
    code = [o for o in kept if _names_code(o) and _split(o)[0] != "imports" and not _split(o)[0].startswith("hydra")]
    if code:
        raise ConfigError(
            f"the run in {folder} was started with {code[0]}, which names code, and a resume never runs code that "
            "a run folder names: if you trust it, repeat that override on the command line"
        )
    return [*(o for o in kept if not _names_code(o)), *argv]


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg: DictConfig) -> Any:
    """The Hydra task function: one run (see :func:`attnlab.training.lifecycle.run`)."""
    from attnlab.training.lifecycle import run

    return run(cfg)


def main(argv: list[str] | None = None) -> None:
    """``python train.py ...``: check the overrides, run Hydra, and exit 1 if a job of a multirun failed. Ctrl-C or
    SIGTERM during a multirun ends it with its report (the jobs so far) and exit code 130, as a single run ends."""
    from attnlab.training.sweep import failed_jobs, report_interrupted

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        check_group_choices(args, CONF_DIR)
        check_plugins(args)
        check_keys(args)
        args = with_run_overrides(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.argv = [sys.argv[0] or str(Path("train.py")), *args]
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # Lightning has its own during training
    try:
        hydra_main()
    except KeyboardInterrupt:
        if report_interrupted():
            print("error: the sweep was interrupted (Ctrl-C or SIGTERM); the jobs above finished", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failed_jobs():
        raise SystemExit(1)


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    """SIGTERM outside training ends the command as Ctrl-C does (the run or sweep says so, exit 130)."""
    raise KeyboardInterrupt
