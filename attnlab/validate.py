"""Check a whole config before any training starts, and fail with one clear line.

:func:`check_group_choices` runs on the command line's overrides before Hydra composes anything (an unknown
``variant=adittive`` gets "did you mean 'additive'?"), and :func:`validate_config` on the composed config.
Both raise :class:`ConfigError`, whose message is a single line naming what is wrong and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnlab.registry import unknown_name_message

__all__ = ["ConfigError", "check_group_choices", "group_choices", "validate_config"]

# config groups a user picks on the command line (``group=choice``)
GROUPS = ("variant", "mask", "task", "model", "trainer", "logger", "experiment", "debug", "hparams_search")


class ConfigError(ValueError):
    """A config value that cannot work. The message is one line."""


def group_choices(conf_dir: Path, group: str) -> list[str]:
    """The options of a config group: the yaml files in ``conf_dir/group``."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def check_group_choices(overrides: Iterable[str], conf_dir: Path) -> None:
    """Reject ``group=choice`` overrides whose choice has no yaml file, before Hydra composes.

    Sweeps (``variant=dot,additive``) are checked item by item; ``null`` is allowed for optional groups.
    """
    for arg in overrides:
        if "=" not in arg or arg.startswith(("-", "+", "~", "hydra")):
            continue
        key, value = arg.split("=", 1)
        key = key.removeprefix("override ").strip()
        if key not in GROUPS or not (conf_dir / key).is_dir():
            continue
        values = value.split(",") if not value.startswith(("choice(", "range(", "interval(", "tag(")) else []
        for v in values:
            v = v.strip().strip("'\"")
            if v in ("null", ""):
                continue
            choices = group_choices(conf_dir, key)
            if v not in choices:
                raise ConfigError(unknown_name_message(key, v, choices))


def _positive_int(cfg: Any, key: str, minimum: int = 1) -> None:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")


def _masks(spec: Any) -> Iterable[dict[str, Any]]:
    """Every mask spec in a (possibly composite) mask config."""
    if isinstance(spec, str):
        yield {"name": spec}
    elif isinstance(spec, dict):
        yield spec
        for sub in spec.get("masks") or []:
            yield from _masks(sub)


def validate_config(cfg: DictConfig) -> None:
    """Check sizes, learning rate and variant/mask/task names and parameters; raise :class:`ConfigError`."""
    from attnlab.masks import list_masks
    from attnlab.scores import list_scores

    for key in ("d_model", "num_heads", "num_layers", "batch_size", "max_steps"):
        _positive_int(cfg, key)
    if cfg.d_k is None:
        if cfg.d_model % cfg.num_heads:
            raise ConfigError(
                f"d_model ({cfg.d_model}) is not divisible by num_heads ({cfg.num_heads}); "
                f"set d_k explicitly (d_k is free of d_model and num_heads) or pick num_heads dividing {cfg.d_model}"
            )
    else:
        _positive_int(cfg, "d_k")
    lr = cfg.lr
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr < 0:
        raise ConfigError(f"lr must be a finite number >= 0, got {lr!r}")
    if cfg.get("seed") is not None and (not isinstance(cfg.seed, int) or cfg.seed < 0):
        raise ConfigError(f"seed must be an integer >= 0, got {cfg.seed!r}")

    variant = cfg.variant.name
    if variant not in list_scores():
        raise ConfigError(unknown_name_message("variant", variant, list_scores()))
    params = cfg.variant.get("params")
    params = OmegaConf.to_container(params, resolve=True) if OmegaConf.is_config(params) else dict(params or {})
    if variant == "relative_position":
        clip = params.get("clip", 16)
        if isinstance(clip, bool) or not isinstance(clip, int) or clip < 0:
            raise ConfigError(f"variant.params.clip must be an integer >= 0 for relative_position, got {clip!r}")

    mask = OmegaConf.to_container(cfg.mask, resolve=True) if OmegaConf.is_config(cfg.mask) else cfg.mask
    for spec in _masks(mask):
        name = spec.get("name")
        if name not in list_masks():
            raise ConfigError(unknown_name_message("mask", name, list_masks()))
        if name == "sliding_window":
            window = spec.get("window")
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise ConfigError(f"mask window must be an integer >= 1, got {window!r}")

    from attnlab.tasks import TASKS

    if cfg.task.name not in TASKS:
        raise ConfigError(unknown_name_message("task", cfg.task.name, list(TASKS)))
