"""Attention diagnostics during training.

:class:`AttentionDiagnostics` runs the encoder's eager path on a fixed probe batch from the validation data at
step 0 (initialisation, before any update), every ``every_n_steps`` optimizer steps, and at the end of training,
and logs :func:`attnlab.metrics.attention_stats` for every layer and head:
``attn/L{layer}H{head}/{metric}``, layer means ``attn/L{layer}/{metric}`` and model means ``attn/{metric}``.
A layer whose attention module has ``differential = True`` (signed weights) is measured with ``signed=True`` and
also logs ``negative_mass``; every other layer with ``signed=False``, so the logged columns never depend on the
values of the weights and are the same at every step.
At the end it also saves ``maps.png`` (layers × heads heatmaps of one probe sequence) in the run folder's
``attention/`` and logs it to W&B when that logger is on. Between those steps the training forward takes the fast
path and computes no weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from torch import Tensor

from attnlab.checks import check_int, check_number
from attnlab.metrics import attention_stats, flatten_stats
from attnlab.runs import atomic_open

__all__ = ["AttentionDiagnostics", "DivergenceError", "DivergenceGuard", "plot_attention_maps"]


def plot_attention_maps(weights: list[Tensor], tokens: Tensor, pad_id: int | None, path: str | Path) -> Path:
    """Save a (layers × heads) grid of heatmaps of one sequence's attention weights, with a colour bar (0 to 1) and
    the token positions (from 0) on the axes.

    Args:
        weights: one (H, L, L) tensor per layer.
        tokens: (L,) the sequence, used to trim padding.
        pad_id: padding token or None.
        path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = int((tokens != pad_id).sum()) if pad_id is not None else tokens.shape[0]
    num_layers, num_heads = len(weights), weights[0].shape[0]
    fig, axes = plt.subplots(
        num_layers, num_heads, figsize=(2.2 * num_heads + 0.8, 2.2 * num_layers), squeeze=False, constrained_layout=True
    )
    ticks = sorted({0, (n - 1) // 2, n - 1})  # token positions, counted from 0
    image = None
    for layer, w in enumerate(weights):
        for head in range(num_heads):
            ax = axes[layer][head]
            image = ax.imshow(w[head, :n, :n].float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"L{layer} H{head}", fontsize=8)
            ax.set_xticks(ticks)
            ax.set_yticks(ticks)
            ax.tick_params(labelsize=6, length=2)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    fig.supxlabel("key position")
    fig.supylabel("query position")
    path = Path(path)
    with atomic_open(path, "wb") as f:  # replaced whole (and a link there replaced, never written through)
        fig.savefig(f, dpi=80, format="png")
    plt.close(fig)
    return path


class AttentionDiagnostics(L.Callback):
    """Entropy, saturation and friends per layer and head on a fixed probe batch.

    Args:
        every_n_steps: log every N optimizer steps (besides step 0 and the end); 0 = only step 0 and the end.
        probe_size: number of validation sequences in the probe batch.
        threshold: the max-weight threshold of ``saturation``.
        heatmaps: save ``maps.png`` at the end (and log it to W&B).
        output_dir: the folder the heatmaps go to (default: ``attention/`` in the trainer's ``default_root_dir``).
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        probe_size: int = 8,
        threshold: float = 0.99,
        heatmaps: bool = True,
        output_dir: str | Path | None = None,
    ) -> None:
        self.every_n_steps = check_int("diagnostics.every_n_steps", every_n_steps, minimum=0)
        self.probe_size = check_int("diagnostics.probe_size", probe_size, minimum=1)
        self.threshold = check_number("diagnostics.threshold", threshold, 0.0, 1.0, low_open=True, high_open=True)
        self.heatmaps = heatmaps
        self.output_dir = output_dir
        self.initial: dict[str, float] = {}
        self.final: dict[str, float] = {}
        self._probe: Tensor | None = None
        self._last_step = -1
        self._resumed: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------ compute

    @torch.no_grad()
    def compute(self, pl_module: L.LightningModule) -> tuple[dict[str, float], list[Tensor]]:
        """Diagnostics of the current model on the probe batch → (flat log dict, per-layer weights (B, H, L, L))."""
        encoder = pl_module.encoder
        tokens = self._probe
        was_training = pl_module.training
        pl_module.eval()
        try:
            _, records = encoder(tokens, need_weights=True)
            prepared = encoder.build_mask(tokens)
            key_mask = None if prepared is None else prepared.allowed
            # differential attention has signed weights: its layers always report negative_mass (the others
            # never), so a run logs the same columns at every step
            per_layer = [
                attention_stats(
                    r.weights,
                    r.logits,
                    key_mask,
                    self.threshold,
                    signed=bool(getattr(layer.self_attn, "differential", False)),
                )
                for r, layer in zip(records, encoder.layers, strict=True)
            ]
        finally:
            pl_module.train(was_training)
        return flatten_stats(per_layer), [r.weights for r in records]

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        step = trainer.global_step
        if step == self._last_step or self._probe is None:
            return {}
        self._last_step = step
        stats, _ = self.compute(pl_module)
        for logger in trainer.loggers:
            logger.log_metrics(stats, step=step)
        return stats

    # ------------------------------------------------------------------------------------------ hooks

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "probe_batch"):
            raise ValueError("AttentionDiagnostics needs a datamodule with probe_batch(n)")
        tokens, _ = datamodule.probe_batch(self.probe_size)
        self._probe = tokens.to(pl_module.device)
        if self._resumed is not None:  # a resumed run: its step-0 diagnostics were logged before, and saved
            self.initial = dict(self._resumed.get("initial", {}))
            self.final = dict(self._resumed.get("final", {}))
            self._last_step = int(self._resumed.get("last_step", -1))
            self._resumed = None
        if trainer.global_step == 0:
            self.initial = self._log(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0:
            self.final = self._log(trainer, pl_module) or self.final

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.final = self._log(trainer, pl_module) or self.final
        if self.heatmaps and trainer.is_global_zero and self._probe is not None:
            _, weights = self.compute(pl_module)
            out = Path(self.output_dir or Path(trainer.default_root_dir) / "attention")
            out.mkdir(parents=True, exist_ok=True)
            pad_id = getattr(pl_module, "pad_id", None)
            path = plot_attention_maps([w[0] for w in weights], self._probe[0], pad_id, out / "maps.png")
            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    logger.log_image("attn/maps", images=[str(path)], step=trainer.global_step)

    # ------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Saved in every checkpoint, so that a resumed run reports the step-0 diagnostics (``attn_init``) and
        does not log a step twice."""
        return {"initial": dict(self.initial), "final": dict(self.final), "last_step": self._last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # applied when training starts: Lightning also loads callback states for trainer.test(ckpt_path=...),
        # where they must not replace the diagnostics of the run that just ended
        self._resumed = dict(state_dict)

    def results(self) -> tuple[dict[str, float], dict[str, float]]:
        """(step-0, final) model means, read right after fitting. A run resumed at its last step trains no more,
        so its restored state is taken over here rather than at train start."""
        if self._resumed is not None:
            self.initial = dict(self._resumed.get("initial", {}))
            self.final = dict(self._resumed.get("final", {}))
            self._resumed = None
        return self.model_means(self.initial), self.model_means(self.final)

    def model_means(self, stats: dict[str, float]) -> dict[str, float]:
        """Only the model-level ``attn/{metric}`` entries of a flat stats dict."""
        return {k: v for k, v in stats.items() if k.count("/") == 1}


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or gradient."""


class DivergenceGuard(L.Callback):
    """Stop at once when the loss or the gradient norm becomes NaN or inf.

    Checked after the backward pass and before the optimizer step (so a bad update is never applied), every
    ``every_n_steps`` steps. The check is one fused ``isfinite`` on the loss and the total gradient norm: a single
    host-device sync per checked step.
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        self.every_n_steps = max(1, int(every_n_steps))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        if step % self.every_n_steps:
            return
        loss = getattr(pl_module, "last_loss", None)
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        grad_norm = (
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else None
        )
        checks = [t for t in (loss, grad_norm) if t is not None]
        if not checks or bool(torch.isfinite(torch.stack([c.float() for c in checks])).all()):
            return
        if loss is not None and not torch.isfinite(loss):
            raise DivergenceError(f"training diverged at step {step}: loss is {loss.item()}")
        bad = next(n for n, p in pl_module.named_parameters() if p.grad is not None and not p.grad.isfinite().all())
        raise DivergenceError(f"training diverged at step {step}: gradient is {grad_norm.item()} (first in {bad})")
