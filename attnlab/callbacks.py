"""Attention diagnostics during training.

:class:`AttentionDiagnostics` runs the encoder's eager path on a fixed probe batch from the validation data at
step 0 (initialisation, before any update), every ``every_n_steps`` optimizer steps, and at the end of training,
and logs :func:`attnlab.metrics.attention_stats` for every layer and head:
``attn/L{layer}H{head}/{metric}``, layer means ``attn/L{layer}/{metric}`` and model means ``attn/{metric}``.
A layer whose form says its weights are signed (:meth:`attnlab.forms.Form.weights_signed`: differential attention,
the decay and delta-rule forms, RWKV-7, MTA) is measured with ``signed=True, probability_rows=False``: it logs
``negative_mass``, and its ``entropy``, ``entropy_norm``, ``max_prob`` and ``saturation`` are NaN (null in
``metrics.jsonl``), since its rows are no probability distributions; the model means of those are then of the other
layers. Every other layer is measured with ``signed=False``, so the logged columns never depend on the values of
the weights and are the same at every step. Every probe logs ``attn/L{layer}/signed`` (1 for such a layer, 0
otherwise) and ``attn/signed``, the fraction of the layers that are signed. Each layer's statistics use that
layer's own mask.

With ``heads=True`` (the default) the same probes also log what the heads do (:mod:`attnlab.heads`): the
dilution of each head on the validation probe (``near_mass``, ``locality``), each layer's rank collapse
(``attn/L{layer}/rank_residual`` after the attention sublayer and ``attn/L{layer}/rank_residual_attn`` of the
attention output alone; model means over the layers), and, on a second probe of repeated random tokens ``[x; x]``
(:meth:`~attnlab.tasks.base.SequenceTask.repeated_probe`), the head-type scores ``prev_token``, ``duplicate``,
``induction`` and ``local`` per head, with ``attn/{score}_max`` the largest over every head of every layer. A task
without a vocabulary (pixels) has no repeated probe: its runs log no head-type scores (:attr:`notes` says why).
Every probe also logs ``attn/L{layer}/act_max``, the largest |activation| of the residual stream after the layer over
the real tokens, and ``attn/act_max``, the largest over the layers (the massive activations that Qiu et al. 2025's
output gate lowers).
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
from attnlab.heads import HEAD_SCORES, dilution, head_scores, rank_residual
from attnlab.metrics import attention_stats, flatten_stats, gate_stats
from attnlab.runs import atomic_open

__all__ = ["AttentionDiagnostics", "DivergenceError", "DivergenceGuard", "plot_attention_maps", "weights_signed"]


def plot_attention_maps(weights: list[Tensor], tokens: Tensor, pad_id: int | None, path: str | Path) -> Path:
    """Save a (layers × heads) grid of heatmaps of one sequence's attention weights, with a colour bar (0 to 1) and
    the token positions (from 0) on the outer edges.

    The grid is one image (the maps side by side, blank gaps between them) in one pair of axes, its labels drawn as
    text, in a layout fixed in inches: matplotlib's constrained layout over an axes per map measured every tick
    label, which was most of the figure's cost (0.4 s, 9 % of a 4.7 s default run; now a few hundredths).

    Args:
        weights: one (H, L, L) tensor per layer.
        tokens: (L,) the sequence, used to trim padding.
        pad_id: padding token or None.
        path: the PNG to write.
    """
    import numpy as np
    from matplotlib.figure import Figure  # (no pyplot: no global figure manager, no backend to choose)

    n = int((tokens != pad_id).sum()) if pad_id is not None else tokens.shape[0]
    n = max(n, 1)  # (a probe of padding only: its first position)
    num_layers, num_heads = len(weights), weights[0].shape[0]
    gap = max(1, round(n * 0.22))  # blank columns and rows between maps, about a quarter of a map
    mosaic = np.full((num_layers * (n + gap) - gap, num_heads * (n + gap) - gap), np.nan, dtype=np.float32)
    for layer, w in enumerate(weights):
        maps = w[:, :n, :n].float().cpu().numpy()  # (H, n, n)
        for head in range(num_heads):
            r, c = layer * (n + gap), head * (n + gap)
            mosaic[r : r + n, c : c + n] = maps[head]
    cell, left, bottom, top, right = 1.7, 0.75, 0.6, 0.3, 1.1  # inches; a map is `cell` wide
    grid_w, grid_h = cell * mosaic.shape[1] / n, cell * mosaic.shape[0] / n
    width, height = left + grid_w + right, bottom + grid_h + top
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((left / width, bottom / height, grid_w / width, grid_h / height))
    cmap = _colormap("viridis")
    image = ax.imshow(mosaic, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
    ax.set_axis_off()
    ticks = sorted({0, (n - 1) // 2, n - 1})  # token positions, counted from 0
    step = cell / n  # inches per position
    for layer in range(num_layers):
        y_top = height - top - layer * (n + gap) * step  # the map's top edge
        for head in range(num_heads):
            x = left + (head * (n + gap) + n / 2) * step
            fig.text(x / width, (y_top + 0.04) / height, f"L{layer} H{head}", ha="center", va="bottom", fontsize=8)
        for t in ticks:  # query positions, left of the first column
            fig.text(
                (left - 0.05) / width, (y_top - (t + 0.5) * step) / height, str(t), ha="right", va="center", fontsize=6
            )
    for head in range(num_heads):  # key positions, under the last row
        for t in ticks:
            x = left + (head * (n + gap) + t + 0.5) * step
            fig.text(x / width, (bottom - 0.05) / height, str(t), ha="center", va="top", fontsize=6)
    bar = fig.add_axes(
        ((width - right + 0.25) / width, (bottom + 0.1 * grid_h) / height, 0.12 / width, 0.8 * grid_h / height)
    )
    fig.colorbar(image, cax=bar, label="attention weight")
    fig.text((left + grid_w / 2) / width, 0.1 / height, "key position", ha="center", va="bottom")
    fig.text(0.12 / width, (bottom + grid_h / 2) / height, "query position", rotation=90, ha="left", va="center")
    path = Path(path)
    with atomic_open(path, "wb") as f:  # replaced whole (and a link there replaced, never written through)
        fig.savefig(f, dpi=80, format="png")
    return path


def _colormap(name: str) -> Any:
    """A matplotlib colormap by name, its missing values (the gaps between maps) white."""
    import matplotlib

    cmap = matplotlib.colormaps[name].copy()
    cmap.set_bad("white")
    return cmap


class AttentionDiagnostics(L.Callback):
    """Entropy, saturation and friends per layer and head on a fixed probe batch, and what the heads do.

    Args:
        every_n_steps: log every N optimizer steps (besides step 0 and the end); 0 = only step 0 and the end.
        probe_size: number of validation sequences in the probe batch (and of repeated-token sequences).
        threshold: the max-weight threshold of ``saturation``.
        heatmaps: save ``maps.png`` at the end (and log it to W&B).
        output_dir: the folder the heatmaps go to (default: ``attention/`` in the trainer's ``default_root_dir``).
        heads: also log the head-type scores, rank collapse and dilution (:mod:`attnlab.heads`).
        window: the local score's window ±w.
        near_keys: dilution's k nearest keys.
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        probe_size: int = 8,
        threshold: float = 0.99,
        heatmaps: bool = True,
        output_dir: str | Path | None = None,
        heads: bool = True,
        window: int = 2,
        near_keys: int = 4,
    ) -> None:
        self.every_n_steps = check_int("diagnostics.every_n_steps", every_n_steps, minimum=0)
        self.probe_size = check_int("diagnostics.probe_size", probe_size, minimum=1)
        self.threshold = check_number("diagnostics.threshold", threshold, 0.0, 1.0, low_open=True, high_open=True)
        self.heatmaps = heatmaps
        self.output_dir = output_dir
        self.heads = bool(heads)
        self.window = check_int("diagnostics.window", window, minimum=0)
        self.near_keys = check_int("diagnostics.near_keys", near_keys, minimum=1)
        self.initial: dict[str, float] = {}
        self.final: dict[str, float] = {}
        self.notes: list[str] = []
        """Why a part of the diagnostics is not logged (a task with no vocabulary: no head-type scores)."""
        self._probe: Tensor | None = None
        self._repeated: Tensor | None = None
        self._last_step = -1
        self._maps: list[Tensor] | None = None  # the first probe sequence's weights (H, L, L) per layer, at _last_step
        self._resumed: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------ compute

    @torch.no_grad()
    def compute(self, pl_module: L.LightningModule) -> tuple[dict[str, float], list[Tensor]]:
        """Diagnostics of the current model on the probe batch → (flat log dict, per-layer weights (B, H, L, L))."""
        encoder = pl_module.encoder
        tokens = self._probe
        was_training = pl_module.training
        pl_module.eval()
        inputs: list[Tensor] = []  # each layer's input (B, L, d_model), for the state after its attention
        outputs: list[Tensor] = []  # each layer's output (B, L, d_model): the residual stream, for act_max
        hooks = [layer.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for layer in encoder.layers]
        hooks += [layer.register_forward_hook(lambda _, __, out: outputs.append(out[0])) for layer in encoder.layers]
        try:
            try:
                _, records = encoder(tokens, need_weights=True)
            finally:
                for hook in hooks:
                    hook.remove()
            masks = [None if m is None else m.allowed for m in encoder.build_masks(tokens)]
            # a layer whose form gives signed weights always reports negative_mass and no entropy or saturation
            # (the others never and always), so a run logs the same columns at every step
            signed = [weights_signed(layer.self_attn) for layer in encoder.layers]
            per_layer = [
                attention_stats(r.weights, r.logits, key_mask, self.threshold, signed=s, probability_rows=not s)
                for r, s, key_mask in zip(records, signed, masks, strict=True)
            ]
            keep = None if encoder.pad_id is None else tokens != encoder.pad_id
            for stats, r in zip(per_layer, records, strict=True):
                if r.gate is not None:  # the gated output (Qiu et al. 2025): its mean per head
                    stats.update(gate_stats(r.gate, keep))
            for stats, layer in zip(per_layer, encoder.layers, strict=True):
                if getattr(getattr(layer.self_attn.form, "normalizer", None), "leaves_mass", False):
                    stats["leftover"] = 1.0 - stats["row_mass"]  # stick-breaking: the stick no key took
            ranks: dict[str, list[float]] = {"rank_residual": [], "rank_residual_attn": []}  # one per layer
            if self.heads:
                for stats, r, key_mask in zip(per_layer, records, masks, strict=True):
                    stats.update(dilution(r.weights, key_mask, self.near_keys))
                for layer, x, r in zip(encoder.layers, inputs, records, strict=True):
                    after = x + r.out if layer.norm_first else layer.norm1(x + r.out)  # (eval: no dropout)
                    ranks["rank_residual"].append(float(rank_residual(after, keep)))
                    ranks["rank_residual_attn"].append(float(rank_residual(r.out, keep)))
                if self._repeated is not None:
                    self._head_scores(encoder, per_layer)
        finally:
            pl_module.train(was_training)
        flat = flatten_stats(per_layer)
        # which layers' weights are signed (no entropy or saturation): per layer, and the fraction of the layers
        flat |= {f"attn/L{n}/signed": float(s) for n, s in enumerate(signed)}
        flat["attn/signed"] = sum(signed) / len(signed) if signed else 0.0
        # the largest |activation| of the residual stream after each layer, over the kept positions (the "massive
        # activations" of Sun et al. 2024, which Qiu et al. 2025 report the output gate lowers): the model's entry is
        # the largest over the layers, not their mean
        act = [float(_largest_activation(h, keep)) for h in outputs]
        flat |= {f"attn/L{n}/act_max": v for n, v in enumerate(act)}
        flat["attn/act_max"] = max(act)
        for name, values in ranks.items():  # per layer, not per head: the layer's and the model's (mean) entries
            if values:
                flat |= {f"attn/L{n}/{name}": v for n, v in enumerate(values)}
                flat[f"attn/{name}"] = float(torch.tensor(values, dtype=torch.float64).nanmean())
        if self.heads and self._repeated is not None:
            for name in HEAD_SCORES:
                values = torch.cat([stats[name].double().reshape(-1).cpu() for stats in per_layer])
                finite = values[values.isfinite()]
                flat[f"attn/{name}_max"] = float(finite.max()) if finite.numel() else float("nan")
        return flat, [r.weights for r in records]

    def _head_scores(self, encoder: torch.nn.Module, per_layer: list[dict[str, Tensor]]) -> None:
        """The head-type scores of every layer on the repeated-token probe, into ``per_layer``."""
        tokens = self._repeated
        _, records = encoder(tokens, need_weights=True)
        masks = [None if m is None else m.allowed for m in encoder.build_masks(tokens)]
        for stats, r, key_mask in zip(per_layer, records, masks, strict=True):
            stats.update(head_scores(r.weights, tokens, key_mask, self.window))

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        step = trainer.global_step
        if step == self._last_step or self._probe is None:
            return {}
        self._last_step = step
        stats, weights = self.compute(pl_module)
        self._maps = [w[0].clone() for w in weights] if self.heatmaps else None  # maps.png, if this is the end
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
        self._repeated, self.notes = None, []
        if self.heads:
            repeated = datamodule.repeated_probe(self.probe_size) if hasattr(datamodule, "repeated_probe") else None
            if repeated is not None:
                self._repeated = repeated.to(pl_module.device)
            else:
                why = getattr(datamodule, "no_token_probe", None) or "it has no repeated-token probe"
                self.notes.append(f"no head-type scores for task {getattr(datamodule, 'name', '?')}: {why}")
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
            maps = self._maps  # the probe of this step (no update since): computed once, for the logs and the maps
            if maps is None or self._last_step != trainer.global_step:
                maps = [w[0] for w in self.compute(pl_module)[1]]
            out = Path(self.output_dir or Path(trainer.default_root_dir) / "attention")
            out.mkdir(parents=True, exist_ok=True)
            pad_id = getattr(pl_module, "pad_id", None)
            path = plot_attention_maps(maps, self._probe[0], pad_id, out / "maps.png")
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


def weights_signed(attention: torch.nn.Module) -> bool:
    """Whether an attention module's weights may be negative, as its form says
    (:meth:`attnlab.forms.Form.weights_signed`: differential attention, the decay and delta-rule forms, RWKV-7, MTA);
    a module without a form (a user's own) by its ``differential`` attribute."""
    form = getattr(attention, "form", None)
    if form is not None and hasattr(form, "weights_signed"):
        return bool(form.weights_signed())
    return bool(getattr(attention, "differential", False))


def _largest_activation(h: Tensor, keep: Tensor | None) -> Tensor:
    """max |h| over the batch, the kept positions (``keep`` (B, L) bool, True = a real token; None = all) and the
    channels of h (B, L, d_model)."""
    h = h.detach().abs().amax(dim=-1)  # (B, L)
    return (h if keep is None else h.masked_fill(~keep, 0.0)).max()


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
