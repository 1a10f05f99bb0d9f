"""Kept for scripts that import ``attnlab.train``: the training code lives in :mod:`attnlab.training`."""

from attnlab.training import CONF_DIR, ConfigError, build_module, main, resolve_d_k, run

__all__ = ["CONF_DIR", "ConfigError", "build_module", "main", "resolve_d_k", "run"]
