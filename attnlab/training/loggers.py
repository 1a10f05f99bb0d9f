"""Loggers: the local ``metrics.jsonl`` (always) and the configured one (W&B offline by default, CSV, or none).

Only rank 0 writes. The W&B run lives in the run folder (``<run>/wandb``); its id is kept in ``wandb_id.txt`` so
that a resumed run continues the same W&B run.
"""

from __future__ import annotations

import secrets
import sys
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from attnlab.runs import MetricsFile, RunFileError, RunFolder, atomic_open, is_wandb_id, read_text
from attnlab.training.config import plain, resolve_d_k

__all__ = ["JsonlLogger", "at_global_step", "finish_wandb", "make_loggers", "wandb_run_id"]


def at_global_step(metrics: Mapping[str, Any], step: int | None) -> int | None:
    """The step to log a row of ``metrics`` at: the optimizer steps done (``trainer.global_step``), as the console
    ("step 100/300"), the checkpoints and the diagnostics count them. Lightning logs the metrics of a validation
    during training at its count of the batches that stepped, which takes in the batch just trained only after the
    validation: one less (99). Its rows of ``val/`` metrics move to the step the console prints; the training rows
    stay where Lightning puts them (the loss at step k is that of the weights after k updates)."""
    if step is not None and any(key.startswith("val/") for key in metrics):
        return step + 1
    return step


class JsonlLogger(Logger):
    """A Lightning logger that appends ``{"step": ..., <name>: <value>, ...}`` rows to ``metrics.jsonl``, one per
    logging call, flushed at once (see :class:`attnlab.runs.MetricsFile` for the row count a resume cuts back to).
    """

    def __init__(self, save_dir: str | Path) -> None:
        super().__init__()
        self._save_dir = Path(save_dir)
        self.file: MetricsFile = RunFolder(save_dir).metrics()

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self._save_dir)

    @property
    def log_dir(self) -> str:
        return str(self._save_dir)

    @property
    def path(self) -> Path:
        """``metrics.jsonl``."""
        return self.file.path

    @property
    def rows(self) -> int:
        """Complete rows in ``metrics.jsonl``."""
        return self.file.rows

    @rank_zero_only
    def truncate(self, rows: int) -> None:
        """Keep only the first ``rows`` rows (``truncate(0)`` empties the file)."""
        self.file.truncate(rows)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Hyperparameters go to config.yaml and summary.json, not here."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row: dict[str, Any] = {"step": at_global_step(metrics, step)}
        row.update({k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()})
        self.file.append(row)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.file.close()


class _WandbLogger(WandbLogger):
    """Lightning's WandbLogger without the ``anonymous`` init key, which W&B ≥ 0.19 warns about even when None.

    The W&B config is the run's resolved Hydra config, given at init and nested as in config.yaml (see
    :func:`_wandb`). Lightning passes the module's constructor arguments to :meth:`log_hyperparams` at fit and at
    test: they repeat that config's settings at top level (``d_model``, ``score``, ``betas`` ...), so only what the
    config lacks is taken from them: the task's ``chance_accuracy``, with the module's default
    (``1 / num_classes``) where the task sets none."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._wandb_init.pop("anonymous", None)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        params = vars(params) if isinstance(params, Namespace) else dict(params)
        chance = params.get("chance_accuracy")
        if chance is None and params.get("num_classes"):
            chance = 1.0 / params["num_classes"]
        if chance is not None:
            self.experiment.config.update({"chance_accuracy": float(chance)}, allow_val_change=True)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, at_global_step(metrics, step))


class _CSVLogger(CSVLogger):
    """Lightning's CSVLogger, its validation rows at the step the console prints (:func:`at_global_step`)."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        super().log_metrics(metrics, at_global_step(metrics, step))


def wandb_run_id(folder: RunFolder, resume: bool) -> str:
    """The W&B run id: the folder's own when continuing it (or on a rank > 0), a new one otherwise. Read only:
    the id file is written by :func:`make_loggers`."""
    if (resume or rank_zero_only.rank != 0) and folder.wandb_id_path.exists():
        run_id = read_text(folder.wandb_id_path).strip()
        if not is_wandb_id(run_id):  # W&B names a folder after it: nothing like ../x from a folder
            raise RunFileError(f"{folder.wandb_id_path} does not hold a W&B run id (letters, digits, _ and -)")
        return run_id
    return secrets.token_hex(4)


def _wandb(cfg: DictConfig, folder: RunFolder, run_id: str, name: str, group: str | None) -> WandbLogger:
    import wandb

    lc = cfg.logger
    if rank_zero_only.rank == 0:
        with atomic_open(folder.wandb_id_path) as f:
            f.write(run_id + "\n")
    return _WandbLogger(
        id=run_id,
        resume="allow",
        project=lc.project,
        entity=lc.get("entity"),
        save_dir=str(folder.path),
        name=name,
        group=group,
        job_type=cfg.variant.name,
        mode=lc.mode,
        tags=list(lc.get("tags") or []),
        # d_k as the run uses it (null in the config: d_model // num_heads), as in summary.json: runs group by it
        config={**plain(cfg), "d_k": resolve_d_k(cfg)},
        settings=wandb.Settings(console="off", silent=True),
    )


def make_loggers(cfg: DictConfig, folder: RunFolder, wandb_id: str, name: str, group: str | None) -> list[Any]:
    """The local JSONL logger, always first, plus the configured one (W&B grouped by sweep, with the variant as
    job type, ``name`` from the overrides and the full resolved config)."""
    loggers: list[Any] = [JsonlLogger(folder.path)]
    if cfg.logger.name == "csv":
        loggers.append(_CSVLogger(save_dir=str(folder.path), name="csv", version=""))
    elif cfg.logger.name == "wandb":
        loggers.append(_wandb(cfg, folder, wandb_id, name, group))
    return loggers


def finish_wandb(failed: bool) -> None:
    """Close this job's W&B run (if any), marked failed or not, so the next job of a sweep never reuses it."""
    if "wandb" not in sys.modules:
        return
    import wandb

    if wandb.run is not None:
        wandb.finish(exit_code=1 if failed else 0)
