"""Checkpoints: written atomically, named relative to the run folder, readable with one-line errors, and holding
what an exact resume needs beyond Lightning's own state.

* :class:`AtomicCheckpointIO` writes a checkpoint to a temporary file beside it and renames it into place, so a
  kill during the write leaves the previous checkpoint whole.
* :class:`RunCheckpoint` is Lightning's ModelCheckpoint whose saved state names files relative to its folder, so a
  copied or moved run folder resumes from its own checkpoints, and which never adds a version suffix
  (``best-v1.ckpt``): a run has one ``best.ckpt`` and one ``last.ckpt``.
* :class:`LastCheckpoint` writes ``last.ckpt`` at every validation.
* :class:`RunState` saves the row count of metrics.jsonl, the best validation accuracy so far and the metrics of
  the last validation in every checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

from attnlab.runs import RunFolder, atomic_open
from attnlab.training.config import ConfigError

__all__ = [
    "AtomicCheckpointIO",
    "LastCheckpoint",
    "RunCheckpoint",
    "RunState",
    "check_fits",
    "check_writable",
    "close_restored_loops",
    "make_checkpoints",
    "read_checkpoint",
]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` into a temporary file in the checkpoint's folder, fsync, rename (see
    :func:`attnlab.runs.atomic_open`). Lightning's own save may copy across file systems, which is not atomic."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        with atomic_open(path, "wb") as f:
            torch.save(checkpoint, f)


class RunCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint whose state stores file names relative to its folder (``dirpath``), and re-anchors them
    on load to wherever the folder is now (Lightning would keep the old absolute paths, and forget the best score
    when the folder moved)."""

    _PATH_KEYS = ("best_model_path", "kth_best_model_path", "last_model_path")
    _OWN_FILES = ("best.ckpt", "last.ckpt")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(enable_version_counter=False, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            {key: os.path.basename(state[key]) if state.get(key) else state.get(key) for key in self._PATH_KEYS}
        )
        state["best_k_models"] = {os.path.basename(k): v for k, v in (state.get("best_k_models") or {}).items()}
        state["dirpath"] = "."
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        def here(path: Any) -> str:
            """A file the run wrote (best.ckpt, last.ckpt) in this folder; any other name a checkpoint holds is
            dropped, as "" (Lightning deletes a worse "best" file by that name: never a file of the user's)."""
            name = os.path.basename(path) if isinstance(path, str) else None
            return os.path.join(self.dirpath, name) if name in self._OWN_FILES else ""

        state = dict(state_dict)
        state.update({key: here(state.get(key)) for key in self._PATH_KEYS})
        best_k = state.get("best_k_models") if isinstance(state.get("best_k_models"), dict) else {}
        state["best_k_models"] = {here(k): v for k, v in best_k.items() if here(k)}
        state["dirpath"] = self.dirpath
        super().load_state_dict(state)


class LastCheckpoint(Checkpoint):
    """``last.ckpt`` at every validation during training: what a resume continues from. (Lightning's ``save_last``
    writes it only when the best checkpoint is written.) A :class:`~lightning.pytorch.callbacks.Checkpoint`, so that
    Lightning runs it after the best checkpoint's callback, whose new best score it must save."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            trainer.save_checkpoint(self.path)


def close_restored_loops(trainer: L.Trainer) -> None:
    """After a fit resumed from a checkpoint of the last step (a run killed during its test): Lightning saved that
    checkpoint at the final validation, before it advanced its logging step and closed the epoch, and a fit with
    nothing left to train does neither. Do what the uninterrupted run did, so that the test is logged at the same
    step and epoch. (Lightning's own counters; pinned by the kill-during-the-test test.)"""
    trainer.fit_loop.epoch_loop._batches_that_stepped += 1
    trainer.fit_loop.epoch_progress.increment_completed()


def make_checkpoints(folder: RunFolder) -> tuple[RunCheckpoint, LastCheckpoint]:
    """``best.ckpt`` when val/acc improves (used for the test); ``last.ckpt`` (what a resume continues from)."""
    best = RunCheckpoint(dirpath=folder.checkpoint_dir, filename="best", monitor="val/acc", mode="max")
    return best, LastCheckpoint(folder.checkpoint("last"))


class RunState(L.Callback):
    """Saved in every checkpoint: the row count of metrics.jsonl (rows logged after the checkpoint are dropped on
    resume, whatever their step), the best validation accuracy so far (the module's ``val_acc_best`` MaxMetric is
    not in its state_dict) and the metrics of the last validation (a run resumed at its last step trains no more,
    and reports these)."""

    def __init__(self, jsonl: Any) -> None:
        self.jsonl = jsonl
        self.val_acc_best: float | None = None
        self.metrics: dict[str, float] = {}
        self._trainer: L.Trainer | None = None
        self._restore: dict[str, Any] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get("val/acc_best")
        if value is not None and not trainer.sanity_checking:
            self.val_acc_best = float(value)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.apply_restored(pl_module)

    def apply_restored(self, pl_module: L.LightningModule) -> None:
        """Take over the restored state (at train start, or after a fit that had nothing left to train)."""
        if self._restore is None:
            return
        restore, self._restore = self._restore, None
        self.metrics = dict(restore.get("metrics") or {})
        best = getattr(pl_module, "val_acc_best", None)
        if restore.get("val_acc_best") is not None and best is not None:
            self.val_acc_best = restore["val_acc_best"]
            best.update(torch.tensor(self.val_acc_best, device=pl_module.device))

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1} if trainer else {}
        return {"metrics_rows": self.jsonl.rows, "val_acc_best": self.val_acc_best, "metrics": metrics}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # applied when training starts (Lightning also loads callback states for trainer.test(ckpt_path=...))
        self._restore = dict(state_dict)


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint's contents (``weights_only``), or :class:`ConfigError` naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"checkpoint {path} does not exist")
    if path.stat().st_size == 0:
        raise ConfigError(f"checkpoint {path} is empty (0 bytes): it was cut off while being written")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a torn or foreign file
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {detail})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "global_step" not in ckpt:
        raise ConfigError(f"checkpoint {path} is not a Lightning checkpoint (no state_dict / global_step)")
    step = ckpt["global_step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 or not isinstance(ckpt["state_dict"], dict):
        raise ConfigError(f"checkpoint {path} is not a Lightning checkpoint (global_step {step!r}, state_dict)")
    return ckpt


_ARCHITECTURE = (
    "score",
    "d_model",
    "num_heads",
    "num_layers",
    "d_k",
    "d_v",
    "d_ff",
    "pos_encoding",
    "vocab_size",
    "attention",
)


def _current_key(key: str, ours: Any) -> str:
    """A checkpoint key as this version names it (:func:`attnlab.compat.renamed_state_key`: the presets' bias
    parameters, once in the score, are the layer's position-bias stage since 0.3)."""
    from attnlab.compat import renamed_state_key

    return renamed_state_key(key, ours)


def check_fits(module: torch.nn.Module, ckpt: dict[str, Any], path: str | Path) -> None:
    """:class:`ConfigError` in one line when the checkpoint's weights do not fit ``module``: the settings that
    differ (from the saved hyperparameters) or the first mismatching tensors."""
    ours = module.state_dict()
    theirs = {_current_key(k, ours): v for k, v in ckpt["state_dict"].items()}
    missing, unexpected = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    shapes = [k for k in sorted(ours.keys() & theirs.keys()) if tuple(ours[k].shape) != tuple(theirs[k].shape)]
    if not (missing or unexpected or shapes):
        return
    saved, here = ckpt.get("hyper_parameters") or {}, dict(getattr(module, "hparams", {}))
    settings = [
        f"{k} {saved[k]!r} → {here.get(k)!r}" for k in _ARCHITECTURE if k in saved and k in here and saved[k] != here[k]
    ]
    if settings:
        detail = "it was saved with other settings: " + ", ".join(settings)
    else:
        parts = []
        if shapes:
            k = shapes[0]
            parts.append(
                f"{len(shapes)} tensors differ in shape (e.g. {k}: {tuple(theirs[k].shape)} vs {tuple(ours[k].shape)})"
            )
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
        detail = "; ".join(parts)
    raise ConfigError(f"checkpoint {path} does not fit this model: {detail}")


def check_writable(folder: Path) -> None:
    """:class:`ConfigError` unless files can be created in ``folder`` (created if missing): a run whose
    checkpoints cannot be saved must stop before its first step, not at the test."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write checkpoints to {folder}: {exc.strerror or exc}") from None
