"""The command line: ``python train.py [overrides]`` and ``python train.py -m [sweep]`` (also ``attnlab-train``).

Before Hydra composes anything, the overrides are checked (an unknown group choice, a plugin that is not
installed, the SLURM launcher without a cluster: one line, exit 2), and ``resume=true hydra.run.dir=<run>``
gets the run's own overrides put in front of the command line's, so that a resume needs nothing but the folder.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from attnlab.runs import RunFileError, RunFolder
from attnlab.training.config import CONF_DIR, ConfigError, check_group_choices, check_override_text, group_choices

__all__ = ["check_key_text", "check_keys", "check_plugins", "hydra_main", "main", "with_run_overrides"]

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


def check_plugins(overrides: list[str], dry: bool = False) -> None:
    """One line, not Hydra's composition error, when a choice needs a plugin that is not installed, or the SLURM
    launcher is asked for on a machine without SLURM (``dry``: a ``--dry-run``, which plans a cluster's sweep from
    a laptop, needs no ``srun``)."""
    for arg in overrides:
        key, value = _split(arg)
        plugin = _PLUGINS.get((key, value))
        if plugin is not None and importlib.util.find_spec(plugin[0]) is None:
            raise ConfigError(f"{key}={value} needs the {plugin[1]} extra: pip install -e '.[{plugin[1]}]'")
        if key == "hydra/launcher" and value in _SLURM_LAUNCHERS and not dry and shutil.which("srun") is None:
            raise ConfigError(
                f"hydra/launcher={value} needs a SLURM cluster, and this machine has none (no srun on PATH); "
                "to try the sweep here, use hydra/launcher=local"
            )


def _odd_char(text: str) -> str | None:
    """The first character of ``text`` that is not printable ASCII (what Hydra's grammar never reads in a key, nor
    unquoted in a value), or None."""
    return next((ch for ch in text if not (ch.isascii() and ch.isprintable())), None)


def _named(ch: str) -> str:
    """A character as a message names it: its repr and code point (``'é' (U+00E9)``)."""
    return f"{ch!r} (U+{ord(ch):04X})"


def check_key_text(overrides: list[str]) -> None:
    """One line naming the character, for an override whose *key* is not ASCII (``dé_k=3``, ``task.é=1``): a config
    key is ASCII letters, digits, ``_`` and ``-`` joined by dots, and Hydra's grammar reads nothing else in a key;
    quoting does not help, so the message says so (and the closest key of the config, when there is one), instead
    of the value's advice of :func:`~attnlab.training.config.check_override_text`. Flags and their values are
    skipped."""
    from attnlab.training.config.compose import _FLAGS_WITH_VALUE

    skip = False
    for arg in overrides:
        if skip or arg.startswith("-"):
            skip = not skip and arg in _FLAGS_WITH_VALUE
            continue
        raw = arg.partition("=")[0]
        key = raw.removeprefix("override ").lstrip("+~").strip()
        odd = _odd_char(key)
        if odd is None:
            continue
        close = _closest_key(key)
        hint = f"; did you mean '{close}'?" if close else ""
        raise ConfigError(
            f"cannot read the override {arg!r}: its key {key!r} has {_named(odd)}, and a config key is ASCII only "
            f"(letters, digits, '_' and '-', joined by '.'), whatever the quoting{hint}"
        )


def _closest_key(key: str) -> str | None:
    """The config's key closest to ``key`` (the default config's), or None."""
    import difflib

    known = _config_keys([])
    close = difflib.get_close_matches(key, sorted(known or ()), n=1, cutoff=0.6)
    return close[0] if close else None


def _config_keys(choices: list[str]) -> set[str] | None:
    """Every dotted key of the config composed with the group ``choices``; None when it does not compose."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=choices)
    except Exception:  # a bad group choice is reported elsewhere, anything else by Hydra itself
        return None
    return _flat_keys(OmegaConf.to_container(cfg, resolve=False))


def check_keys(overrides: list[str]) -> None:
    """One line (with the closest key) for ``key=value`` whose key the config does not have, instead of Hydra's
    five-line "Could not override" message. The config is composed with the command line's group choices (the
    first of a sweep's, as Hydra expands it: ``variant=choice(dot,additive)`` → ``variant=dot``); anything this check
    cannot judge is left to Hydra."""
    import difflib

    from attnlab.training.config import GROUPS

    choices, keys = [], []
    for arg in overrides:
        if "=" not in arg or arg.startswith(("-", "+", "~")) or arg.startswith("hydra"):
            continue
        key = _split(arg)[0]
        if key in GROUPS or "/" in key:
            choices.append(arg)
        else:
            keys.append((key, arg))
    if not keys:
        return
    from attnlab.training.plan import _first_values

    try:
        choices = _first_values(choices)
    except ConfigError:  # (reported with the jobs)
        return
    known = _config_keys(choices)
    if known is None:
        return
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


# a run folder's recorded overrides: keys a resume never puts back (the command line's business), and what makes one
# name code (it is then refused): Hydra's instantiation keys, and interpolations, which could assemble them
_NOT_REAPPLIED = ("imports", "hydra")
_CODE_MARKERS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_", "${")
_PLAIN_KEY = re.compile(r"[A-Za-z_]\w*(\.\w+)*", re.ASCII)


def with_run_overrides(argv: list[str]) -> list[str]:
    """For a single run with ``resume=true`` (or ``ckpt_path=last``) and ``hydra.run.dir=<folder>``: the
    overrides of the run's last start (kept in its summary), then the command line's (which win). A command line
    that repeats them is unchanged. Anything else is returned as is.

    The folder is data, never code (:func:`_reapplied`): only plain values and choices of attnlab's own config
    groups are put back."""
    if "-m" in argv or "--multirun" in argv:
        return argv
    pairs = [_split(a) for a in argv if "=" in a]
    values = dict(pairs)
    if str(values.get("resume")).lower() != "true" and values.get("ckpt_path") != "last":
        return argv
    folder = values.get("hydra.run.dir")
    if folder is None:
        raise ConfigError("resume=true continues a run folder: name it with hydra.run.dir=<the run folder>")
    run = RunFolder(folder.strip("'\""))
    try:
        summary = run.read_summary()
    except RunFileError as exc:
        raise ConfigError(f"cannot use the run in {folder}: {exc}") from None
    last = summary.segments[-1].overrides if summary and summary.segments else (summary.overrides if summary else [])
    return [*_reapplied(run, last, {key for key, _ in pairs}), *argv]


def _reapplied(run: RunFolder, recorded: list[str], given: set[str]) -> list[str]:
    """The recorded overrides (the last start's: an extension's larger max_steps included) that a resume puts back:
    not those the command line gives, nor ``resume``/``overwrite``/``ckpt_path``, nor ``imports`` and ``hydra*``
    (the run checks the folder's ``imports`` against the command line's before importing anything). Each is parsed
    as Hydra would; one that names code (a ``_target_``, an interpolation ``${...}``, a key that is not a plain
    dotted name) or a group choice that is not a file of ``conf/`` is refused in one line, naming it, unless the
    command line gives that key itself."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    kept = []
    for text in recorded:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception:  # (Hydra's grammar errors are several lines)
            key, _, value = text.partition("=")
            odd_key, odd_value = _odd_char(key), _odd_char(value)
            why = (
                f": its key has {_named(odd_key)}, and a config key is ASCII only"
                if odd_key
                else f": its value has {_named(odd_value)} unquoted"
                if odd_value and "'" not in value and '"' not in value
                else ""
            )
            raise ConfigError(f"{run.summary_path}: the recorded override {text!r} cannot be parsed{why}") from None
        key = override.key_or_group
        if key in given or key in _NOT_REPEATED or key.split("/")[0].split(".")[0] in _NOT_REAPPLIED:
            continue
        value = override.value()
        group = "." not in key and (CONF_DIR / key).is_dir()
        bad_choice = group and not (value is None or (isinstance(value, str) and value in group_choices(CONF_DIR, key)))
        if override.package is not None or not _PLAIN_KEY.fullmatch(key) or bad_choice:
            reason = f"{key}={value!r} is not a choice of conf/{key}" if bad_choice else "it is not a plain setting"
        elif any(marker in text for marker in _CODE_MARKERS):
            reason = "it names code"
        else:
            kept.append(text)
            continue
        raise ConfigError(
            f"the run in {run.path} was started with {text} ({reason}), and a resume never takes code or files "
            "that a run folder names: if you trust it, repeat that override on the command line"
        )
    return kept


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg: DictConfig) -> Any:
    """The Hydra task function: one run (see :func:`attnlab.training.lifecycle.run`)."""
    from attnlab.training.lifecycle import run

    return run(cfg)


def main(argv: list[str] | None = None) -> None:
    """``python train.py ...``: check the overrides, run Hydra, and exit 1 if a job of a multirun failed. With
    ``--dry-run`` anywhere on the line: print the plan and its estimated minutes instead (nothing is run or written;
    :mod:`attnlab.training.plan`). Ctrl-C or
    SIGTERM during a multirun ends it with its report (the jobs so far) and exit code 130, as a single run ends."""
    from attnlab.training.multirun import failed_jobs, new_command, report_interrupted, signalled

    new_command()
    args = list(sys.argv[1:] if argv is None else argv)
    dry = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    try:
        from attnlab.training.compare import expand_compare

        given = list(args)
        args = expand_compare(args)  # (compare=<name>: its models as variant=<name>/<model>,...; named settings)
        check_group_choices(args, CONF_DIR)
        check_key_text(args)  # (a key that is not ASCII: the character, not the value's advice)
        check_override_text(args)  # (after the choices: variant=scaléd keeps its "did you mean")
        check_plugins(args, dry=dry)
        check_keys(args)
        args = with_run_overrides(args)
        if not dry and any(a in ("-m", "--multirun") for a in args):  # (a dry run's plan checks it itself)
            from attnlab.training.plan import check_sweep_config

            check_sweep_config([a for a in args if a not in ("-m", "--multirun")])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if dry:  # the plan and its cost; nothing is run or written (attnlab.training.plan)
        from attnlab.training.plan import dry_run

        raise SystemExit(dry_run(args, given))
    sys.argv = [sys.argv[0] or str(Path("train.py")), *args]
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        hydra_main()
    except KeyboardInterrupt:
        report_interrupted()
        raise SystemExit(130) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signalled() and report_interrupted():  # a signal swallowed where Python cannot raise (a GC callback)
        raise SystemExit(130)
    if failed_jobs():
        raise SystemExit(1)


def _interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C or SIGTERM: noted (a multirun starts no further job, :func:`attnlab.training.multirun.signalled`), then
    raised as KeyboardInterrupt, which ends the run as interrupted (Lightning keeps its own SIGTERM handler during
    training and calls this one after it)."""
    from attnlab.training.multirun import mark_signalled

    mark_signalled()
    raise KeyboardInterrupt
