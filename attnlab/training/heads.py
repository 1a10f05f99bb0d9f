"""The end-of-run head step: head importance on the validation set and pruning curves on the test set, for
``pruning.json`` (:data:`attnlab.runs.PRUNING_FILE`).

Michel et al. 2019 (*Are Sixteen Heads Really Better than One?*): importance I_h = |∂L/∂ξ_h| (a gate ξ_h = 1 on each
head, :func:`attnlab.heads.head_importance`) averaged over the validation batches, then each layer's scores divided by
their ℓ2 norm, and the heads removed from the least important up (:func:`attnlab.heads.importance_order`), the test
metric measured after each removal; the same for ``random_orders`` random orders (seeds ``seed``, ``seed + 1``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from attnlab.heads import head_importance, importance_order, normalized_importance, pruning_curve, random_order
from attnlab.metrics import flatten_stats
from attnlab.tasks.base import IGNORE_INDEX

__all__ = ["PRUNING_SCHEMA", "evaluate", "prune_heads"]

PRUNING_SCHEMA = 1


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
    is called after each test point (a run's live bar).

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
        importance = head_importance(
            layers, lambda batch: module._loss(batch)[0], _batches(datamodule, "val", device, val_batches), num_heads
        )
        orders: dict[str, list[list[tuple[int, int]]]] = {"importance": [importance_order(importance)]}
        if random_orders:
            orders["random"] = [random_order(len(layers), num_heads, seed + r) for r in range(random_orders)]
        total = sum(len(listed) for listed in orders.values()) * (len(layers) * num_heads + 1)
        done = 0

        def point() -> dict[str, float]:
            nonlocal done
            result = evaluate(module, datamodule, "test", test_batches)
            done += 1
            if progress is not None:
                progress(done, total)
            return result

        curves = {
            name: [pruning_curve(layers, point, order, num_heads) for order in listed]
            for name, listed in orders.items()
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
