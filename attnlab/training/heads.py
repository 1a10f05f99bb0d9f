"""The end-of-run head step: head importance on the validation set and pruning curves on the test set, for
``pruning.json`` (:data:`attnlab.runs.PRUNING_FILE`).

Michel et al. 2019 (*Are Sixteen Heads Really Better than One?*): importance I_h = |∂L/∂ξ_h| (a gate ξ_h = 1 on each
head, :func:`attnlab.heads.head_importance`) averaged over the validation batches, then each layer's scores divided by
their ℓ2 norm, and the heads removed from the least important up (:func:`attnlab.heads.importance_order`), the test
metric measured after each removal; the same for ``random_orders`` random orders (seeds ``seed``, ``seed + 1``, ...).

Both are computed in few, large forwards (:func:`attnlab.heads.sequence_gates`: gates per sequence): the importance
of several validation batches in one backward (each batch its own gates, so its own gradient), and every distinct
point of every curve (the unpruned and the all-removed points are shared by the orders) for a test batch repeated
once per point. A batch of small sequences runs many times faster so on a CPU; the numbers are those of one batch at
a time (each batch's loss is its own mean, each point its own gates).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.heads import importance_order, normalized_importance, random_order, sequence_gates
from attnlab.metrics import flatten_stats
from attnlab.tasks.base import IGNORE_INDEX

__all__ = ["PRUNING_SCHEMA", "evaluate", "prune_heads"]

PRUNING_SCHEMA = 1

TOKENS_PER_FORWARD = 1 << 15
"""About how many token positions one batched forward of the head step holds (at least one batch)."""
ENTRIES_PER_FORWARD = 1 << 24
"""... and at most about this many attention-matrix entries (sequences × heads × L²), at least one batch."""


def _batches(
    datamodule: Any, split: str, device: torch.device, limit: int | None = None
) -> Iterator[tuple[Tensor, Tensor]]:
    """The split's examples in order, ``batch_size`` at a time, on ``device``: its first ``limit`` batches (None:
    all), as the trainer's loader gives them, whatever loader wrappers a distributed run put on the datamodule."""
    tokens, labels = datamodule.tensors(split)
    size = int(datamodule.batch_size)
    for n, start in enumerate(range(0, tokens.shape[0], size)):
        if limit is not None and n >= limit:
            return
        yield tokens[start : start + size].to(device), labels[start : start + size].to(device)


@torch.no_grad()
def evaluate(module: Any, datamodule: Any, split: str = "test", limit: int | None = None) -> dict[str, float]:
    """The module's accuracy and loss on a split (its first ``limit`` batches), as its ``test/acc`` and
    ``test/loss`` count them (micro accuracy over the labelled positions, the loss weighted by them), and ``bpc``
    (the loss in bits) for a language model."""
    device = next(module.parameters()).device
    correct, total, loss_sum = 0, 0, 0.0
    for batch in _batches(datamodule, split, device, limit):
        loss, logits, labels = module._loss(batch)
        valid = labels != IGNORE_INDEX
        count = int(valid.sum())
        correct += int((logits.argmax(dim=-1)[valid] == labels[valid]).sum())
        total += count
        loss_sum += float(loss) * count
    out = {"acc": correct / total if total else math.nan, "loss": loss_sum / total if total else math.nan}
    if getattr(module, "report_bits", False):
        out["bpc"] = out["loss"] / math.log(2)
    return out


def _sequences_per_forward(batch_size: int, length: int, num_heads: int) -> int:
    """How many sequences one batched forward takes: the budgets above, never fewer than one batch."""
    fit = min(TOKENS_PER_FORWARD // max(length, 1), ENTRIES_PER_FORWARD // max(num_heads * length * length, 1))
    return max(batch_size, fit)


def _block_losses(module: Any, tokens: Tensor, labels: Tensor, sizes: list[int]) -> tuple[list[Tensor], Tensor, Tensor]:
    """One forward of ``tokens``, blocks of ``sizes`` sequences one after the other → each block's mean loss, as
    ``module._loss`` computes a batch's, and the flat logits and labels."""
    _, logits, flat_labels = module._loss((tokens, labels))
    per_sequence = flat_labels.shape[0] // tokens.shape[0]  # 1, or L for a per-token task
    bounds = torch.tensor(sizes).cumsum(0).mul(per_sequence).tolist()
    losses = [
        F.cross_entropy(logits[a:b].float(), flat_labels[a:b], ignore_index=IGNORE_INDEX)
        for a, b in zip([0, *bounds[:-1]], bounds, strict=True)
    ]
    return losses, logits, flat_labels


def _importance(module: Any, layers: list[Any], batches: list[tuple[Tensor, Tensor]], num_heads: int) -> Tensor:
    """:func:`attnlab.heads.head_importance` of the batches' mean losses (|∂L_b/∂ξ| averaged over the batches), with
    as many batches per forward and backward as fit: each batch its own gates ξ_b, so ∂(Σ_b L_b)/∂ξ_b = ∂L_b/∂ξ_b."""
    if not batches:
        raise ValueError("head_importance needs at least one batch")
    total = torch.zeros(len(layers), num_heads, dtype=torch.float64)
    size, length = batches[0][0].shape[0], batches[0][0].shape[1]
    per_forward = max(1, _sequences_per_forward(size, length, num_heads) // size)
    for start in range(0, len(batches), per_forward):
        group = batches[start : start + per_forward]
        gates = torch.ones(len(group), len(layers), num_heads, requires_grad=True)
        sizes = torch.tensor([tokens.shape[0] for tokens, _ in group], device=gates.device)
        per_sequence = gates.repeat_interleave(sizes, dim=0)  # (N, layers, H): a batch's gates on its sequences
        tokens = torch.cat([tokens for tokens, _ in group])
        labels = torch.cat([labels for _, labels in group])
        with torch.enable_grad(), sequence_gates(layers, per_sequence):
            losses, _, _ = _block_losses(module, tokens, labels, sizes.tolist())
            (grad,) = torch.autograd.grad(sum(losses), gates)
        for row in grad.detach().abs().double().cpu():  # batch by batch, as head_importance adds them
            total += row
    return total / len(batches)


@torch.no_grad()
def _points(
    module: Any,
    layers: list[Any],
    batches: list[tuple[Tensor, Tensor]],
    settings: list[Tensor],
    num_heads: int,
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, float]]:
    """:func:`evaluate` of the module with each of ``settings`` ((layers, H) gates) on ``batches``: as many
    (setting, batch) pairs per forward as fit (a group of settings, each on a copy of a run of batches);
    ``progress(done)`` after each group of settings."""
    bits = getattr(module, "report_bits", False)
    if not batches:
        return [{"acc": math.nan, "loss": math.nan} | ({"bpc": math.nan} if bits else {}) for _ in settings]
    size, length = batches[0][0].shape[0], batches[0][0].shape[1]
    fit = _sequences_per_forward(size, length, num_heads) // size  # batches per forward
    per_group = max(1, min(len(settings), fit))
    results: list[dict[str, float]] = []
    for start in range(0, len(settings), per_group):
        group = settings[start : start + per_group]
        run = max(1, fit // len(group))  # batches per forward, each once per setting of the group
        losses: list[list[Tensor]] = [[] for _ in group]
        corrects: list[list[Tensor]] = [[] for _ in group]
        counts: list[list[Tensor]] = [[] for _ in group]
        for first in range(0, len(batches), run):
            chunk = batches[first : first + run]
            tokens = torch.cat([t for t, _ in chunk])
            labels = torch.cat([y for _, y in chunk])
            n = tokens.shape[0]
            gates = torch.stack(group).repeat_interleave(n, dim=0)  # (len(group) · n, layers, H)
            sizes = [t.shape[0] for t, _ in chunk] * len(group)
            with sequence_gates(layers, gates):
                parts, logits, flat_labels = _block_losses(
                    module, tokens.repeat(len(group), *[1] * (tokens.dim() - 1)),
                    labels.repeat(len(group), *[1] * (labels.dim() - 1)), sizes,
                )  # fmt: skip
            per_sequence = flat_labels.shape[0] // (n * len(group))
            valid = flat_labels != IGNORE_INDEX
            hits = (logits.argmax(dim=-1) == flat_labels) & valid
            bounds = [m * per_sequence for m in sizes]
            for k, (hit, count) in enumerate(zip(hits.split(bounds), valid.split(bounds), strict=True)):
                g = k // len(chunk)
                losses[g].append(parts[k])
                corrects[g].append(hit.sum())
                counts[g].append(count.sum())
        # one read of the group's numbers; then evaluate's sums, batch by batch
        loss_rows = torch.stack([torch.stack(row) for row in losses]).tolist()
        correct_rows = torch.stack([torch.stack(row) for row in corrects]).tolist()
        count_rows = torch.stack([torch.stack(row) for row in counts]).tolist()
        for batch_losses, batch_correct, batch_counts in zip(loss_rows, correct_rows, count_rows, strict=True):
            correct, total, loss_sum = 0, 0, 0.0
            for loss, hit, count in zip(batch_losses, batch_correct, batch_counts, strict=True):
                correct += int(hit)
                total += int(count)
                loss_sum += float(loss) * int(count)
            out = {"acc": correct / total if total else math.nan, "loss": loss_sum / total if total else math.nan}
            if bits:
                out["bpc"] = out["loss"] / math.log(2)
            results.append(out)
        if progress is not None:
            progress(len(results))
    return results


def prune_heads(
    module: Any,
    datamodule: Any,
    seed: int,
    random_orders: int = 1,
    val_batches: int | None = None,
    test_batches: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Importance on the first ``val_batches`` validation batches, then the pruning curves on the first
    ``test_batches`` test batches (None: all; a run passes the batches its trainer validated and tested on, so that
    the curves' first point is its ``test/acc``), of ``module`` (put in eval mode and back). ``progress(done, total)``
    is called as the distinct test points are measured (``total`` of them, a group at a time: a run's live bar).

    Returns ``(pruning, logged)``: the content of ``pruning.json`` (``schema_version``, ``metric`` (``acc``, or
    ``bpc`` for a language model), ``higher_is_better``, ``num_layers``, ``num_heads``, ``importance`` and
    ``importance_normalized`` (layers × heads), ``orders`` and ``curves`` by order name (``importance``: one curve,
    ``random``: one per random order; a curve is a list of points ``{removed, acc, loss[, bpc]}``), ``auc`` (the
    metric's mean over each order's points, the random orders' averaged)), and the metrics to log: per-head
    ``attn/L{l}H{h}/importance`` (layer and model means too) and ``prune/auc_<order>``."""
    encoder = module.encoder
    layers = list(encoder.layers)
    num_heads = int(encoder.num_heads)
    was_training = module.training
    module.eval()
    try:
        device = next(module.parameters()).device
        val = list(_batches(datamodule, "val", device, val_batches))
        importance = _importance(module, layers, val, num_heads)
        orders: dict[str, list[list[tuple[int, int]]]] = {"importance": [importance_order(importance)]}
        if random_orders:
            orders["random"] = [random_order(len(layers), num_heads, seed + r) for r in range(random_orders)]
        # every point of every curve: the first k heads of the order removed; the same gates are measured once
        keys: dict[tuple[float, ...], int] = {}
        settings: list[Tensor] = []
        index: dict[str, list[list[int]]] = {}
        for name, listed in orders.items():
            index[name] = []
            for order in listed:
                gates = torch.ones(len(layers), num_heads)
                row = []
                for k in range(len(order) + 1):
                    if k:
                        gates[order[k - 1]] = 0.0
                    key = tuple(gates.reshape(-1).tolist())
                    if key not in keys:
                        keys[key] = len(settings)
                        settings.append(gates.clone())
                    row.append(keys[key])
                index[name].append(row)
        total = len(settings)
        test = list(_batches(datamodule, "test", device, test_batches))
        points = _points(
            module, layers, test, settings, num_heads,
            None if progress is None else (lambda done: progress(done, total)),
        )  # fmt: skip
        curves = {
            name: [[{"removed": k, **points[i]} for k, i in enumerate(row)] for row in rows]
            for name, rows in index.items()
        }
    finally:
        module.train(was_training)
    metric = "bpc" if getattr(module, "report_bits", False) else "acc"
    auc = {
        name: float(sum(sum(p[metric] for p in curve) / len(curve) for curve in listed) / len(listed))
        for name, listed in curves.items()
    }
    pruning = {
        "schema_version": PRUNING_SCHEMA,
        "metric": metric,
        "higher_is_better": metric == "acc",
        "num_layers": len(layers),
        "num_heads": num_heads,
        "importance": importance.tolist(),
        "importance_normalized": normalized_importance(importance).tolist(),
        "orders": {name: [[list(lh) for lh in order] for order in listed] for name, listed in orders.items()},
        "curves": curves,
        "auc": auc,
    }
    logged = flatten_stats([{"importance": row} for row in importance])
    logged |= {f"prune/auc_{name}": value for name, value in auc.items()}
    return pruning, logged
