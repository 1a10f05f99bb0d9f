"""Per-head attention diagnostics: entropy, confidence, saturation, distance and logit scale.

All functions are pure tensor code (no module state, no Python loops over rows) and work on one
layer's attention at a time:

* ``weights``  -- (B, H, Lq, Lk) attention probabilities ``p_ij``; each row sums to 1 over its visible keys,
  rows with no visible key are all zero.
* ``logits``   -- (B, H, Lq, Lk) pre-softmax scores ``s_ij`` (optional); masked entries may be ``-inf`` or
  arbitrary and are ignored.
* ``key_mask`` -- bool, broadcastable to (B, H, Lq, Lk); True = key j is visible to query i (may be attended).
  ``None`` means every key is visible. Typical shapes: (B, 1, 1, Lk) padding, (Lq, Lk) causal.

Every statistic is computed per row (one query of one head of one example), then averaged per head over all
valid rows of all batch elements pooled together, giving a tensor of shape (H,). A row is *valid* when it has
at least one visible key; rows with no visible key are excluded from every average. A head with no valid row
gets NaN. Computation is done in float32 (float64 if the input is float64), so bf16/fp16 inputs are fine; the
outputs are detached.

Metrics (``n_i`` = number of visible keys of row i, sums over visible keys j):

* ``entropy``       ``H_i = -sum_j p_ij log p_ij`` in nats (``0 log 0 = 0``).
* ``entropy_norm``  ``H_i / log n_i``: 1 for a uniform row, 0 for a one-hot row. Undefined for ``n_i < 2``,
  so such rows are left out of this average only; NaN for a head where no row has two visible keys.
* ``max_prob``      ``max_j p_ij``, the head "confidence" of Voita et al. 2019, *Analyzing Multi-Head
  Self-Attention: Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned* (ACL 2019).
* ``saturation``    fraction of rows with ``max_j p_ij > threshold`` (default 0.99): the softmax sits in its
  flat region where gradients vanish. This is the failure mode that motivates the ``1/sqrt(d_k)`` scaling in
  Vaswani et al. 2017, *Attention Is All You Need*, §3.2.1: for q, k with unit-variance components,
  ``Var(q.k) = d_k``, so unscaled logits with large ``d_k`` push the softmax into saturation.
* ``attn_distance`` ``sum_j p_ij |i - j|`` with query and key positions counted from 0. This assumes
  self-attention alignment (query i and key i are the same token); for cross-attention it is only a
  distance between indices.
* ``logit_std``     population standard deviation of the row's logits over its visible keys
  (``sqrt(mean_j (s_ij - mean_j s_ij)^2)``), averaged over rows. Only when ``logits`` is given.
* ``logit_max``     maximum logit over all visible entries (max over batch, rows and keys, per head).
  Only when ``logits`` is given; NaN for a head with no visible entry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["attention_stats", "flatten_stats", "summarize"]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_mean(values: Tensor, rows: Tensor) -> Tensor:
    """Mean over (B, Lq) of ``values`` (B, H, Lq) restricted to ``rows`` (bool, B, H, Lq) -> (H,).

    NaN for a head with no selected row (0 / 0)."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    total = torch.where(rows, values, zero).sum(dim=(0, 2))
    count = rows.sum(dim=(0, 2)).to(values.dtype)
    return total / count


@torch.no_grad()
def attention_stats(
    weights: Tensor,
    logits: Tensor | None = None,
    key_mask: Tensor | None = None,
    threshold: float = 0.99,
) -> dict[str, Tensor]:
    """Per-head attention statistics of one layer.

    Args:
        weights: (B, H, Lq, Lk) attention probabilities; rows sum to 1 over visible keys.
        logits: (B, H, Lq, Lk) pre-softmax scores, or None. Masked entries are ignored (may be -inf).
        key_mask: bool, broadcastable to (B, H, Lq, Lk); True = key visible. None = all keys visible.
        threshold: a row is saturated when its largest weight is strictly greater than this.

    Returns:
        Dict of detached (H,) tensors, each the mean over all valid (b, i) rows of the per-row value:
        ``entropy`` = -sum_j p log p (nats), ``entropy_norm`` = entropy / log(n_visible) over rows with
        n_visible >= 2 (NaN if there is none), ``max_prob`` = max_j p, ``saturation`` = mean of
        [max_j p > threshold], ``attn_distance`` = sum_j p |i - j|; and, if ``logits`` is given,
        ``logit_std`` (population std over visible keys, row mean) and ``logit_max`` (max over visible
        entries of all rows and batch elements). Rows with no visible key are excluded everywhere.
    """
    if weights.dim() != 4:
        raise ValueError(f"weights must be (B, H, Lq, Lk), got shape {tuple(weights.shape)}")
    if logits is not None and logits.shape != weights.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} != weights shape {tuple(weights.shape)}")
    dtype = _work_dtype(weights.dtype)
    p = weights.detach().to(dtype)
    _, _, lq, lk = p.shape
    zero = torch.zeros((), dtype=dtype, device=p.device)

    if key_mask is None:
        visible = torch.ones_like(p, dtype=torch.bool)
    else:
        visible = torch.broadcast_to(key_mask.detach().to(device=p.device, dtype=torch.bool), p.shape)
    p = torch.where(visible, p, zero)

    n_visible = visible.sum(dim=-1)  # (B, H, Lq)
    valid = n_visible > 0
    n_float = n_visible.to(dtype)

    # Entropy with 0 log 0 = 0 (the inner where keeps log away from 0, so no NaN appears anywhere).
    positive = p > 0
    plogp = torch.where(positive, p * torch.log(torch.where(positive, p, torch.ones_like(p))), zero)
    entropy = -plogp.sum(dim=-1)

    normable = n_visible >= 2
    log_n = torch.log(torch.where(normable, n_float, torch.full_like(n_float, 2.0)))
    entropy_norm = entropy / log_n  # only read where normable

    max_prob = p.amax(dim=-1)
    saturated = (max_prob > threshold).to(dtype)

    i = torch.arange(lq, device=p.device, dtype=dtype).unsqueeze(-1)
    j = torch.arange(lk, device=p.device, dtype=dtype).unsqueeze(0)
    distance = (p * (i - j).abs()).sum(dim=-1)

    stats = {
        "entropy": _row_mean(entropy, valid),
        "entropy_norm": _row_mean(entropy_norm, valid & normable),
        "max_prob": _row_mean(max_prob, valid),
        "saturation": _row_mean(saturated, valid),
        "attn_distance": _row_mean(distance, valid),
    }

    if logits is not None:
        # Logits keep their own precision (float64 stays float64). Masked entries (possibly -inf or NaN)
        # are replaced by 0 before any arithmetic and never counted.
        ldtype = _work_dtype(logits.dtype)
        s = logits.detach().to(device=p.device, dtype=ldtype)
        s0 = torch.where(visible, s, torch.zeros((), dtype=ldtype, device=p.device))
        safe_n = n_visible.clamp_min(1).to(ldtype)  # rows with no visible key are dropped by _row_mean
        mean = s0.sum(dim=-1, keepdim=True) / safe_n.unsqueeze(-1)
        dev = torch.where(visible, s0 - mean, torch.zeros((), dtype=ldtype, device=p.device))
        std = torch.sqrt((dev * dev).sum(dim=-1) / safe_n)
        stats["logit_std"] = _row_mean(std, valid)
        s_max = torch.where(visible, s, torch.full_like(s, -math.inf)).amax(dim=(0, 2, 3))
        any_visible = visible.any(dim=-1).any(dim=-1).any(dim=0)
        stats["logit_max"] = torch.where(any_visible, s_max, torch.full_like(s_max, math.nan))

    return stats


def summarize(stats: Mapping[str, Tensor]) -> dict[str, float]:
    """Reduce per-head (H,) tensors to model-level floats: the NaN-ignoring mean over heads.

    A metric that is NaN for every head stays NaN."""
    return {name: float(torch.nanmean(value.detach().double().reshape(-1))) for name, value in stats.items()}


def flatten_stats(per_layer: Sequence[Mapping[str, Tensor]], prefix: str = "attn") -> dict[str, float]:
    """Flatten per-layer stats (one ``attention_stats`` dict per layer, layers counted from 0) to log names.

    Produces ``{prefix}/L{layer}H{head}/{metric}`` for every head, ``{prefix}/L{layer}/{metric}``
    (NaN-ignoring mean over the layer's heads) and ``{prefix}/{metric}`` (NaN-ignoring mean over all heads
    of all layers pooled together, so layers with more heads weigh more). A metric missing from some layers
    is averaged over the layers that have it.
    """
    out: dict[str, float] = {}
    pooled: dict[str, list[Tensor]] = {}
    for layer, stats in enumerate(per_layer):
        for metric, value in stats.items():
            v = value.detach().double().reshape(-1).cpu()
            for head, x in enumerate(v.tolist()):
                out[f"{prefix}/L{layer}H{head}/{metric}"] = x
            out[f"{prefix}/L{layer}/{metric}"] = float(torch.nanmean(v))
            pooled.setdefault(metric, []).append(v)
    for metric, values in pooled.items():
        out[f"{prefix}/{metric}"] = float(torch.nanmean(torch.cat(values)))
    return out
