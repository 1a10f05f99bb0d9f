"""EncoderModule: the attnlab :class:`~attnlab.encoder.Encoder` plus a classification head, as a LightningModule.

Per-sequence tasks pool the encoder output (mean over non-pad tokens) into (B, C) logits; per-token tasks give
(B, L, C) logits and ignore labels equal to ``IGNORE_INDEX`` (−100). AdamW with linear warm-up then cosine decay,
stepped every optimizer step. Accuracy is torchmetrics' micro-averaged multiclass accuracy.

Besides ``train/*``, ``val/*`` and ``test/*`` (loss, acc), a run logs:

* ``test/acc@L`` and ``test/loss@L`` for each of the task's ``test_lengths`` (length generalisation);
* ``val/bpc`` and ``test/bpc`` (and ``test/bpc@L``) for language-modelling tasks: the cross-entropy in bits;
* ``train/steps_to_99``: the first validated step at which ``val/acc >= 0.99``, and ``train/plateau_steps``: the
  first at which ``val/acc`` has left chance, i.e. is at least ``chance + 0.1 * (1 - chance)`` (``chance`` is the
  task's ``chance_accuracy``, by default ``1 / num_classes``). Both are measured at validations (every
  ``eval_every`` steps), logged from then on, and absent from the summary when never reached.

:meth:`EncoderModule.compile_forward` compiles the training forward pass (encoder, pooling and head) in place with
``torch.compile``; :func:`compile_problem` says beforehand whether ``torch.compile`` can run on a device at all.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from attnlab.config import AttentionConfig, pattern_name
from attnlab.encoder import Encoder, as_attention_config
from attnlab.tasks.base import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "EncoderModule",
    "compile_problem",
    "deterministic_flags",
    "set_deterministic_flags",
    "warmup_cosine",
]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    """Learning-rate multiplier: linear 0 → 1 over ``warmup_steps``, then cosine 1 → ``min_ratio`` at
    ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# torch.compile: each training batch shape is one static graph (usually two: the batch and an epoch's last one). Past
# Dynamo's limit per function (8) shapes would run eagerly, and which ones would depend on the order a run met them.
RECOMPILE_LIMIT = 64

_compile_problems: dict[str, str | None] = {}


def compile_problem(device: torch.device | str = "cpu") -> str | None:
    """Why ``torch.compile`` cannot run on ``device`` here (no C++ compiler, no Triton, an unsupported platform),
    found by compiling and running one tiny function there, or None when it can. Cached per device type."""
    kind = torch.device(device).type
    if kind not in _compile_problems:
        try:
            probe = torch.compile(lambda x: x * 2 + 1, dynamic=False, fullgraph=True)
            ok = bool(torch.equal(probe(torch.ones(4, device=device)), torch.full((4,), 3.0, device=device)))
            _compile_problems[kind] = None if ok else "a compiled test function computed a wrong result"
        except Exception as exc:  # whatever the toolchain raises: the run goes on eagerly, with one warning line
            first = next((line for line in str(exc).splitlines() if line.strip()), "")
            _compile_problems[kind] = f"{type(exc).__name__}: {first.strip()[:200]}".rstrip(": ")
    return _compile_problems[kind]


def deterministic_flags() -> tuple[bool, bool, bool]:
    """torch's deterministic-algorithm settings: (enabled, warnings only, fill new tensors with NaN)."""
    import torch.utils.deterministic

    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )


def set_deterministic_flags(flags: tuple[bool, bool, bool]) -> None:
    """Put back settings that :func:`deterministic_flags` returned."""
    import torch.utils.deterministic

    enabled, warn_only, fill = flags
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def given_configs(attention: Any) -> list[AttentionConfig] | AttentionConfig | None:
    """``attention`` as :class:`AttentionConfig` (one for every layer, or a list of them): configs as they are,
    their fields as dicts (a user's script, a saved module's hyperparameters) built once here
    (:func:`~attnlab.encoder.as_attention_config`); None when it is the 0.2 form (a dict of the stages beside
    ``score``), which the encoder's keyword arguments take as they are."""
    if isinstance(attention, list | tuple):
        return [as_attention_config(c) for c in attention]
    if isinstance(attention, AttentionConfig):
        return attention
    if isinstance(attention, dict) and ("score" in attention or "mask" in attention):  # a config's fields
        return as_attention_config(attention)
    return None


class EncoderModule(L.LightningModule):
    """Encoder + linear head, trained with cross-entropy.

    Args:
        vocab_size, num_classes, per_token, pad_id, max_len: from the task.
        d_model, num_heads, num_layers, d_k, d_v, d_ff: sizes (d_k default d_model // num_heads).
        attention: each layer's attention: an :class:`~attnlab.config.AttentionConfig` (or its fields as a dict)
            for every layer, or a list of ``num_layers`` of them (per-layer attention). The configs go to the
            encoder as they are; the hyperparameters hold them as plain dicts, one per layer (made once, where they
            are saved), from which a checkpoint builds the module again.
        pattern: the name of the per-layer pattern (``model.pattern``, e.g. ``LG``), recorded for the run.
        score, score_params, mask: the attention of every layer as before (an older run's hyperparameters): with
            ``attention`` as a dict of the other AttentionConfig fields, they make one AttentionConfig.
        pos_encoding, norm_first, dropout: encoder options; canon, canon_width: Canon layers
            (:class:`~attnlab.encoder.EncoderLayer`, ``model.canon``).
        lr, weight_decay, warmup_steps, max_steps, betas: AdamW with warm-up + cosine decay over ``max_steps``.
        test_lengths: the task's extra test lengths: test dataloader ``k >= 1`` is length ``test_lengths[k - 1]``.
        report_bits: log ``val/bpc`` and ``test/bpc`` (language modelling).
        chance_accuracy: the task's chance level for ``train/plateau_steps`` (``None`` → ``1 / num_classes``).
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        per_token: bool,
        pad_id: int | None,
        max_len: int,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        d_k: int | None = None,
        d_v: int | None = None,
        d_ff: int | None = None,
        score: str = "scaled_dot",
        score_params: dict[str, Any] | None = None,
        mask: Any = None,
        pos_encoding: str = "sinusoidal",
        canon: str | None = None,
        canon_width: int = 4,
        norm_first: bool = True,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        max_steps: int = 1000,
        betas: tuple[float, float] = (0.9, 0.98),
        attention: Any = None,
        pattern: str | None = None,
        test_lengths: tuple[int, ...] | list[int] = (),
        report_bits: bool = False,
        chance_accuracy: float | None = None,
    ) -> None:
        super().__init__()
        configs = given_configs(attention)
        self.save_hyperparameters(ignore=["attention", "score", "score_params", "mask", "d_v"])
        old = {} if configs is not None else dict(attention or {})  # 0.2's hyperparameters: the stages as options
        if configs is None:
            old |= {"score": score, "score_params": dict(score_params or {}), "mask": mask, "d_v": d_v}
        self.encoder = Encoder(
            vocab_size,
            d_model,
            num_heads,
            num_layers,
            d_k=d_k,
            d_ff=d_ff,
            pad_id=pad_id,
            pos_encoding=pos_encoding,
            canon=canon,
            canon_width=canon_width,
            max_len=max_len,
            dropout=dropout,
            norm_first=norm_first,
            attention=configs,
            **old,
        )
        # the one place the configs become plain data: the hyperparameters (hparams.yaml, checkpoints) hold each
        # layer's fields, which given_configs reads back when a checkpoint builds the module again
        self.hparams["attention"] = [c.to_dict() for c in self.encoder.attention_configs]
        self.pattern = pattern_name(self.encoder.attention_configs, pattern)
        self.head = nn.Linear(d_model, num_classes)
        self.per_token = per_token
        self.pad_id = pad_id
        self.num_parameters = sum(p.numel() for p in self.parameters())
        self.train_acc = MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX)
        self.test_acc = MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX)
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()
        self.test_lengths = tuple(int(length) for length in test_lengths)
        self.length_acc = nn.ModuleList(
            MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX) for _ in self.test_lengths
        )
        self.length_loss = nn.ModuleList(MeanMetric() for _ in self.test_lengths)
        self.report_bits = bool(report_bits)
        self.chance_accuracy = 1.0 / num_classes if chance_accuracy is None else float(chance_accuracy)
        self.milestones: dict[str, float] = {
            "train/plateau_steps": self.chance_accuracy + 0.1 * (1 - self.chance_accuracy),
            "train/steps_to_99": 0.99,
        }
        self.reached: dict[str, int] = {}  # milestone → step; saved in checkpoints

    # ----------------------------------------------------------------------------------------- compile

    def compile_forward(
        self,
        example: tuple[Tensor, Tensor] | None = None,
        deterministic: bool = True,
        context: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> str | None:
        """Compile the training forward pass in place with ``torch.compile`` (inductor): each training step runs
        the encoder, pooling and head compiled, forward and backward. Parameter names, and so ``state_dict`` keys
        and checkpoints, stay as they are: a checkpoint loads with compile on or off.

        Validation and test call :meth:`forward` itself, eagerly, as does the diagnostics callback (the encoder
        with ``need_weights=True``): their batch shapes (validation, test, their last batches, the task's test
        lengths) would each be one more compile, for a few % of a run's work. Shapes are static
        (``dynamic=False``): the training batch and an epoch's shorter last batch compile once each, and a shape
        always runs the same kernels, whatever the run met before, so that same-seed runs and resumes agree.
        ``deterministic`` turns on torch's deterministic algorithms (warnings only, and without filling new tensors
        with NaN) for the process, unless they are on already: without them the compiled backward of an embedding or
        a gather adds with atomics, in an order that differs between runs on more than one thread. The mask is
        prepared outside the graph (its dataclass is not traceable): one break after the embedding.

        ``example`` (a training batch ``(tokens, labels)``, on the module's device): one eager forward pass on it
        first does the model's lazy set-up (loading or building attnlab's fused kernels: traced, that file-system
        work would be a graph break inside the layer loop, and Dynamo would leave the layers eager); then one
        compiled forward and backward pass compiles the training graph now. Both leave the random state and the
        gradients as they were, and run inside ``context()`` (the trainer's precision, e.g. bf16 autocast), so that
        the first training step finds its graph. Without ``example``, give the module one eager forward pass before
        compiling. If the compiled pass fails (an op that inductor or a custom op's fake kernel gets wrong), the
        module is eager again, torch's deterministic flags are as they were, and the reason, one line, is returned;
        else None. An error of the eager pass is the model's own, and is raised.
        """
        import torch._dynamo
        import torch.utils.deterministic

        if example is not None:
            with self._trial(example, context):
                self.forward(example[0])
        torch._dynamo.reset()  # a run compiles anew, also after earlier runs in this process (a sweep's jobs)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        flags = deterministic_flags()
        if deterministic and not flags[0]:
            # inductor then keeps aten's deterministic index_put (the embedding's backward) instead of atomic adds,
            # whose order, and so the last bits of the sums, varies from run to run with more than one thread
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = False  # every torch.empty is written anyway
        self.encoder.build_masks = torch.compiler.disable(self.encoder.build_masks)
        self.compile(dynamic=False)
        if example is None:
            return None
        try:
            with self._trial(example, context):
                self._loss(example)[0].backward()
        except Exception as exc:  # the run goes on eagerly, and says why
            self._compiled_call_impl = None
            del self.encoder.build_masks
            set_deterministic_flags(flags)
            text = " ".join(str(exc).split())
            return f"{type(exc).__name__}: {text[:240]}" if text else type(exc).__name__
        return None

    @contextlib.contextmanager
    def _trial(
        self, example: tuple[Tensor, Tensor], context: Callable[[], AbstractContextManager[Any]] | None
    ) -> Iterator[None]:
        """A pass in training mode on ``example`` that leaves no trace: the random state (dropout), the mode and the
        gradients are as they were afterwards."""
        device, was_training = example[0].device, self.training
        forked = {"devices": []} if device.type == "cpu" else {"devices": [device], "device_type": device.type}
        try:
            with torch.random.fork_rng(**forked), context() if context is not None else contextlib.nullcontext():
                self.train()
                yield
        finally:
            self.train(was_training)
            for parameter in self.parameters():
                parameter.grad = None

    @property
    def compiled(self) -> bool:
        """Whether :meth:`compile_forward` has compiled this module."""
        return getattr(self, "_compiled_call_impl", None) is not None

    # ----------------------------------------------------------------------------------------- forward

    def pool(self, h: Tensor, tokens: Tensor) -> Tensor:
        """Mean over non-pad positions: h (B, L, d_model) → (B, d_model)."""
        if self.pad_id is None:
            return h.mean(dim=1)
        keep = (tokens != self.pad_id).unsqueeze(-1).to(h.dtype)  # (B, L, 1)
        return (h * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (B, L) → logits (B, L, C) for per-token tasks, (B, C) otherwise."""
        h = self.encoder(tokens)  # (B, L, d_model)
        return self.head(h if self.per_token else self.pool(h, tokens))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        tokens, labels = batch
        logits = self(tokens) if self.training else self.forward(tokens)  # (compile=true: compiled in training only)
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_labels = labels.reshape(-1)
        loss = F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=IGNORE_INDEX)
        return loss, flat_logits, flat_labels

    # ----------------------------------------------------------------------------------------- steps

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, logits, labels = self._loss(batch)
        self.last_loss = loss.detach()  # read by DivergenceGuard before the optimizer step
        self.train_acc(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, prog_bar=False)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits, labels = self._loss(batch)
        self.val_loss(loss, weight=(labels != IGNORE_INDEX).sum())
        self.val_acc(logits, labels)
        self.log("val/loss", self.val_loss)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        acc = self.val_acc.compute()
        self.val_acc_best(acc)
        # values from torchmetrics' compute() are reduced over the processes already, and equal on all of them:
        # sync_dist, as Lightning asks of epoch-level values under DDP, with max, which leaves them exactly so
        synced: dict[str, Any] = {"sync_dist": True, "reduce_fx": "max"}
        self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=True, **synced)
        if self.report_bits:
            self.log("val/bpc", self.val_loss.compute() / math.log(2), **synced)
        for name, threshold in self.milestones.items():
            if name not in self.reached and float(acc) >= threshold:
                self.reached[name] = int(self.global_step)
            if name in self.reached:
                self.log(name, float(self.reached[name]), **synced)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["milestones"] = dict(self.reached)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.reached = {str(k): int(v) for k, v in (checkpoint.get("milestones") or {}).items()}

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        loss, logits, labels = self._loss(batch)
        weight = (labels != IGNORE_INDEX).sum()
        if dataloader_idx == 0:
            acc, mean_loss, suffix = self.test_acc, self.test_loss, ""
        else:
            k = dataloader_idx - 1
            acc, mean_loss, suffix = self.length_acc[k], self.length_loss[k], f"@{self.test_lengths[k]}"
        mean_loss(loss, weight=weight)
        acc(logits, labels)
        self.log(f"test/loss{suffix}", mean_loss, add_dataloader_idx=False)
        self.log(f"test/acc{suffix}", acc, add_dataloader_idx=False)

    def on_test_epoch_end(self) -> None:
        if not self.report_bits:
            return
        synced: dict[str, Any] = {"sync_dist": True, "reduce_fx": "max"}  # (as in on_validation_epoch_end)
        self.log("test/bpc", self.test_loss.compute() / math.log(2), **synced)
        for length, mean_loss in zip(self.test_lengths, self.length_loss, strict=True):
            self.log(f"test/bpc@{length}", mean_loss.compute() / math.log(2), **synced)

    # ----------------------------------------------------------------------------------------- optimisation

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            # matrices decay; biases, norms, per-head scalars, the token embedding and position tables do not
            table = name.startswith(("encoder.embed.", "encoder.pos."))
            (decay if p.dim() >= 2 and not table else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=tuple(hp.betas),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, hp.max_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
