"""The bottom of :mod:`attnlab.training.config`: what every part of it shares.

Where the config lives (:data:`CONF_DIR`) and its groups (:data:`GROUPS`), the one error every check raises
(:class:`ConfigError`: one line naming the key, its value and what is allowed), and the small helpers that turn a
library's ``ValueError`` into it (:func:`_check`, :func:`_prefixed`, :func:`_flag`), read a node as plain data
(:func:`plain`) or build a model on the meta device (:func:`_on_meta`). It imports no other part of the package.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

__all__ = ["CONF_DIR", "CUSTOM_GROUPS", "GROUPS", "MAX_STEPS", "ConfigError", "plain"]


CONF_DIR = Path(__file__).resolve().parents[3] / "conf"

# config groups a user picks on the command line (``group=choice``)
GROUPS = (
    "variant",
    "mask",
    "normalizer",
    "position_bias",
    "task",
    "model",
    "trainer",
    "logger",
    "experiment",
    "compare",
    "debug",
    "hparams_search",
)
# groups whose ``custom`` choice selects a name registered by the user's own module (through ``imports``)
CUSTOM_GROUPS = {
    "variant": "score",
    "mask": "mask",
    "normalizer": "normalizer",
    "position_bias": "position bias",
    "task": "task",
}

MAX_STEPS = 10**9  # a billion optimizer steps (11 days at a millisecond each): beyond it a budget is a typo


class ConfigError(ValueError):
    """A request that cannot start: a bad config value, or a run folder that does not allow it. One line."""


def plain(node: Any) -> Any:
    """An OmegaConf node as plain Python containers (resolved); anything else unchanged."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _check(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _prefixed(prefix: str, exc: Exception, keys: Iterable[str]) -> ConfigError:
    """A builder's error as one line naming the config key: ``clip must be ...`` → ``variant.params.clip ...``."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    key = next((k for k in keys if message.startswith(f"{k} ")), None)
    return ConfigError(f"{prefix}{message}" if key else f"{prefix.rstrip('.')}: {message}")


def _flag(cfg: Any, key: str, name: str | None = None) -> None:
    """A boolean at ``key`` of ``cfg``; the error names it ``name`` (default ``key``)."""
    value = OmegaConf.select(cfg, key) if OmegaConf.is_config(cfg) else cfg.get(key)
    if not isinstance(value, bool):
        raise ConfigError(f"{name or key} must be true or false, got {value!r}")


def _on_meta(build: Any) -> Any:
    """``build()`` on torch's meta device, where a module of any size takes no memory (its sizes are judged by
    :func:`~attnlab.training.config.budgets._check_memory`); a user's module that needs real tensors to be built is
    built on the CPU instead. A bad value (TypeError, ValueError, :class:`ConfigError`) is raised either way."""

    import torch

    try:
        with torch.device("meta"):
            return build()
    except (TypeError, ValueError):
        raise
    except Exception:
        return build()
