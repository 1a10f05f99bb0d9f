"""Training: compose the config, check it, and run it in a run folder that never loses data.

One concern per module:

* :mod:`~attnlab.training.config`: where the config lives, whole-config validation (one-line errors), and what the
  config builds (the module, the threads); what a resume may change.
* :mod:`~attnlab.training.data`: a training loader that resumes mid-pass, evaluation loaders for several processes.
* :mod:`~attnlab.training.loggers`: metrics.jsonl, W&B (offline by default), CSV.
* :mod:`~attnlab.training.checkpoints`: atomic, relocatable checkpoints and the state an exact resume needs.
* :mod:`~attnlab.training.console`: what a run prints and writes to train.log.
* :mod:`~attnlab.training.progress`: the step progress bar and a line per validation.
* :mod:`~attnlab.training.lifecycle`: :func:`run`, the steps of one run, with resume and its guarantees.
* :mod:`~attnlab.training.sweep`: Hydra callbacks: run-folder guard, multirun progress and final table.
* :mod:`~attnlab.training.multirun`: a multirun's state (job folders, signals, estimates) and its final report.
* :mod:`~attnlab.training.cli`: ``python train.py``.

Nothing here imports Lightning at import time: a bad command line fails in about a second.
"""

from attnlab.training.cli import main
from attnlab.training.config import CONF_DIR, ConfigError, build_module, resolve_d_k, validate_config
from attnlab.training.lifecycle import run

__all__ = ["CONF_DIR", "ConfigError", "build_module", "main", "resolve_d_k", "run", "validate_config"]
