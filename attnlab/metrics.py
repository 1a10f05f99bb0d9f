"""Per-head attention diagnostics: entropy, confidence, saturation, distance, row mass, support, first-key mass
and logit scale.

All functions are pure tensor code (no module state, no Python loops over rows) and work on one
layer's attention at a time:

* ``weights``  -- (B, H, Lq, Lk) attention weights ``w_ij`` from any normalizer. For softmax each row sums to 1
  over its visible keys. Other normalizers break that: softmax1 and a learned sink give rows summing to less
  than 1, sigmoid rows sum to anything >= 0, sparsemax / entmax15 / softpick put exact zeros on visible keys
  (softpick rows may even be all zero), and differential attention (``softmax_1 - lambda softmax_2``) gives
  signed weights. Entries at masked keys are ignored (read as 0), whatever they hold.
* ``logits``   -- (B, H, Lq, Lk) pre-normalizer scores ``s_ij`` (optional); masked entries may be ``-inf`` or
  arbitrary and are ignored. A normalizer that combines k maps per head (differential attention: k = 2) sees
  (B, k*H, Lq, Lk) logits, component-major (map c of head h at index ``c*H + h``); each map's rows then count as
  rows of their head for ``logit_std`` and ``logit_max``.
* ``key_mask`` -- bool, broadcastable to (B, H, Lq, Lk); True = key j is visible to query i (may be attended).
  ``None`` means every key is visible. Typical shapes: (B, 1, 1, Lk) padding, (Lq, Lk) causal.

Every statistic is computed per row (one query of one head of one example), then averaged per head over all
valid rows of all batch elements pooled together, giving a tensor of shape (H,). A row is *valid* when it has
at least one visible key; rows with no visible key are excluded from every average. A head with no valid row
gets NaN. Computation is done in float32 (float64 if the input is float64), so bf16/fp16 inputs are fine; the
outputs are detached.

The distribution statistics (``entropy``, ``entropy_norm``, ``max_prob``, ``saturation``, ``attn_distance``)
describe *where* a row attends, not how much: they are computed on the row renormalised over its nonnegative
part, ``p_ij = max(w_ij, 0) / sum_j max(w_ij, 0)``. For softmax weights this is the row itself (up to float
rounding), so nothing changes; for softmax1, sink or sigmoid it is the shape of the row with its mass divided
out (``0.5 * softmax`` has the entropy of ``softmax``); for signed weights negative entries count as 0. A valid
row whose nonnegative mass is 0 (an all-zero softpick row, an all-nonpositive signed row) has no distribution:
it is left out of these five averages, and a head none of whose rows has one gets NaN for them. It still
counts for ``row_mass``, ``support`` and ``negative_mass``, which are over all valid rows.

Weights that are no probability rows at all (``probability_rows=False``: a layer whose form says its weights are
signed, :meth:`attnlab.forms.Form.weights_signed`: differential attention, the decay and delta-rule forms, RWKV-7,
MTA's head mixing) get no ``entropy``, ``entropy_norm``, ``max_prob`` or ``saturation`` (:data:`PROBABILITY_STATS`):
they are NaN for every head, so the logged columns stay the same, and the model means are of the other layers. Their
``attn_distance`` is still that of each row's nonnegative part (where the row reads from), and every raw-weight
statistic is kept.

Metrics (``n_i`` = number of visible keys of row i, sums over visible keys j):

* ``entropy``       ``H_i = -sum_j p_ij log p_ij`` in nats (``0 log 0 = 0``).
* ``entropy_norm``  ``H_i / log n_i``: 1 for a uniform row, 0 for a one-hot row. ``n_i`` counts every visible
  key, zero-weight ones included, so a sparse row scores below 1. Undefined for ``n_i < 2``, so such rows are
  left out of this average only; NaN for a head where no row with a distribution has two visible keys.
* ``max_prob``      ``max_j p_ij``, the head "confidence" of Voita et al. 2019, *Analyzing Multi-Head
  Self-Attention: Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned* (ACL 2019).
* ``saturation``    fraction of rows with ``max_j p_ij > threshold`` (default 0.99): the softmax sits in its
  flat region where gradients vanish. This is the failure mode that motivates the ``1/sqrt(d_k)`` scaling in
  Vaswani et al. 2017, *Attention Is All You Need*, §3.2.1: for q, k with unit-variance components,
  ``Var(q.k) = d_k``, so unscaled logits with large ``d_k`` push the softmax into saturation.
* ``attn_distance`` ``sum_j p_ij |i - j|`` with query and key positions counted from 0. This assumes
  self-attention alignment (query i and key i are the same token); for cross-attention it is only a
  distance between indices.
* ``row_mass``      ``sum_j w_ij`` on the raw weights: 1 for softmax, below 1 for softmax1, a sink or softpick,
  anything >= 0 for sigmoid, any sign for signed weights. Rows of mass 0 count (as 0).
* ``support``       fraction of the visible keys with ``w_ij != 0``: 1 for softmax (unless it underflows),
  below 1 for sparse normalizers (sparsemax, entmax15, softpick); 0 for an all-zero row.
* ``first_mass``    ``w_i0``, the raw weight on the first key: the "attention sink" of Xiao et al. 2024
  (*Efficient Streaming Language Models with Attention Sinks*), where softmax parks the mass a head does not want
  to spend. Averaged over the valid rows i >= 1 that see key 0 (row 0 is left out: under a causal mask it sees only
  key 0, and its weight there says nothing); NaN when there is no such row.
* ``negative_mass`` ``sum_j max(-w_ij, 0)``, the weight a signed row (differential attention, the delta rule) puts
  below zero. Present when ``signed=True`` (then also for weights that happen to be all >= 0, where it is 0), or
  when ``signed=None`` and some visible weight is negative; never with ``signed=False``.
* ``leftover``      ``1 − sum_j w_ij``, the mass a stick-breaking row leaves unspent (Tan et al. 2025: the stick
  no key took, Π_k (1 − β_ik)), averaged over the valid rows; reported for a layer whose normalizer leaves mass
  (``leaves_mass``: ``stickbreaking``), beside ``row_mass``.
* ``gate_mean``     the output gate's mean σ(x W_g) per head over the valid query rows (and, elementwise, the
  channels): Qiu et al. 2025 ("Gated Attention for Large Language Models", §4) report it small and sparse once
  trained (:func:`gate_stats`; only for a layer with ``output_gate``).
* ``logit_std``     population standard deviation of the row's logits over its visible keys
  (``sqrt(mean_j (s_ij - mean_j s_ij)^2)``), averaged over rows. Only when ``logits`` is given.
* ``logit_max``     maximum logit over all visible entries (max over batch, rows and keys, per head).
  Only when ``logits`` is given; NaN for a head with no visible entry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "PROBABILITY_STATS",
    "RowDistribution",
    "attention_stats",
    "flatten_stats",
    "gate_stats",
    "row_distribution",
    "summarize",
]

PROBABILITY_STATS: tuple[str, ...] = ("entropy", "entropy_norm", "max_prob", "saturation")
"""The statistics that read a row as a probability distribution: NaN for weights that are no probability rows
(:func:`attention_stats` with ``probability_rows=False``: a form whose weights are signed)."""


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


class RowDistribution(NamedTuple):
    """One layer's weights read as distributions (:func:`row_distribution`), all (B, H, Lq, Lk) but the rows."""

    weights: Tensor  # the weights in the working dtype, 0 at masked keys
    visible: Tensor  # bool: key j visible to query i
    p: Tensor  # the row's distribution: max(w, 0) / Σ_j max(w, 0) over visible keys; 0 in rows without one
    has_dist: Tensor  # (B, H, Lq) bool: the row has a visible key and positive mass


def row_distribution(weights: Tensor, key_mask: Tensor | None = None) -> RowDistribution:
    """Each row of ``weights`` (B, H, Lq, Lk) as a distribution over its visible keys (``key_mask`` broadcastable,
    True = visible; None = all): its nonnegative part renormalised to sum 1, in float32 (float64 stays float64),
    detached. What :func:`attention_stats` and :mod:`attnlab.heads` read."""
    if weights.dim() != 4:
        raise ValueError(f"weights must be (B, H, Lq, Lk), got shape {tuple(weights.shape)}")
    dtype = _work_dtype(weights.dtype)
    w = weights.detach().to(dtype)
    zero = torch.zeros((), dtype=dtype, device=w.device)
    if key_mask is None:
        visible = torch.ones_like(w, dtype=torch.bool)
    else:
        visible = torch.broadcast_to(key_mask.detach().to(device=w.device, dtype=torch.bool), w.shape)
    w = torch.where(visible, w, zero)
    # rows without positive mass have no distribution (the where keeps their division at 0 / 1: no NaN anywhere)
    pos = w.clamp_min(0)
    pos_mass = pos.sum(dim=-1)
    has_dist = visible.any(dim=-1) & (pos_mass > 0)
    p = pos / torch.where(has_dist, pos_mass, torch.ones_like(pos_mass)).unsqueeze(-1)
    return RowDistribution(w, visible, p, has_dist)


@torch.no_grad()
def attention_stats(
    weights: Tensor,
    logits: Tensor | None = None,
    key_mask: Tensor | None = None,
    threshold: float = 0.99,
    signed: bool | None = None,
    probability_rows: bool = True,
) -> dict[str, Tensor]:
    """Per-head attention statistics of one layer.

    Args:
        weights: (B, H, Lq, Lk) attention weights from any normalizer: rows may sum to 1 (softmax), less
            (softmax1, sink, softpick), anything >= 0 (sigmoid), hold exact zeros (sparsemax, entmax15,
            softpick) or be signed (differential attention). Entries at masked keys are ignored.
        logits: (B, H, Lq, Lk) pre-normalizer scores, or (B, k*H, Lq, Lk) for k maps per head, component-major
            (differential attention, k = 2), or None. Masked entries are ignored (may be -inf).
        key_mask: bool, broadcastable to (B, H, Lq, Lk); True = key visible. None = all keys visible.
        threshold: a row is saturated when its largest renormalised weight is strictly greater than this.
        signed: whether to report ``negative_mass``: True always (0 for nonnegative weights), False never,
            None (default) only when some visible weight (of any head) is negative, which costs one
            device-to-host read; callers that know their normalizer should say so.
        probability_rows: False for weights that are no probability rows (a form whose weights are signed,
            :meth:`attnlab.forms.Form.weights_signed`): ``entropy``, ``entropy_norm``, ``max_prob`` and ``saturation``
            (:data:`PROBABILITY_STATS`) are then NaN for every head; everything else is as with True.

    Returns:
        Dict of detached (H,) tensors, each the mean over valid (b, i) rows (at least one visible key) of the per-row
        value. On the row renormalised over its nonnegative part, p = max(w, 0) / sum_j max(w, 0), and over the valid
        rows whose nonnegative mass is > 0 only: ``entropy`` = -sum_j p log p (nats), ``entropy_norm`` = entropy /
        log(n_visible) over those rows with n_visible >= 2 (NaN if there is none), ``max_prob`` = max_j p,
        ``saturation`` = mean of [max_j p > threshold], ``attn_distance`` = sum_j p |i - j|. On the raw weights, over
        all valid rows: ``row_mass`` = sum_j w, ``support`` = #{j: w != 0} / n_visible, ``first_mass`` = w_i0 (over the
        rows i >= 1 that see key 0), and (see ``signed``) ``negative_mass`` = sum_j max(-w, 0). If ``logits`` is given,
        ``logit_std`` (population std over visible keys, row mean) and ``logit_max`` (max over visible entries of all
        rows and batch elements), the rows of all k maps of a head pooled. Rows with no visible key are excluded
        everywhere. For softmax weights the renormalisation changes nothing beyond float rounding. With
        ``probability_rows=False`` the statistics of :data:`PROBABILITY_STATS` are NaN.
    """
    if weights.dim() != 4:
        raise ValueError(f"weights must be (B, H, Lq, Lk), got shape {tuple(weights.shape)}")
    if logits is not None and (
        logits.dim() != 4
        or logits.shape[0] != weights.shape[0]
        or logits.shape[2:] != weights.shape[2:]
        or logits.shape[1] % weights.shape[1] != 0
    ):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} must be weights shape {tuple(weights.shape)}, "
            "or that with k times as many heads"
        )
    if signed is not None and not isinstance(signed, bool):
        raise TypeError(f"signed must be True, False or None, got {signed!r}")
    if not isinstance(probability_rows, bool):
        raise TypeError(f"probability_rows must be True or False, got {probability_rows!r}")
    w, visible, p, has_dist = row_distribution(weights, key_mask)
    dtype = w.dtype
    b, h, lq, lk = w.shape
    zero = torch.zeros((), dtype=dtype, device=w.device)

    n_visible = visible.sum(dim=-1)  # (B, H, Lq)
    valid = n_visible > 0
    n_float = n_visible.to(dtype)
    safe_n = n_visible.clamp_min(1).to(dtype)  # rows with no visible key are dropped by _row_mean

    # Raw-weight statistics, over every valid row.
    row_mass = w.sum(dim=-1)
    support = (w != 0).sum(dim=-1).to(dtype) / safe_n

    # Entropy with 0 log 0 = 0 (the inner where keeps log away from 0).
    positive = p > 0
    plogp = torch.where(positive, p * torch.log(torch.where(positive, p, torch.ones_like(p))), zero)
    entropy = -plogp.sum(dim=-1)

    normable = n_visible >= 2
    log_n = torch.log(torch.where(normable, n_float, torch.full_like(n_float, 2.0)))
    entropy_norm = entropy / log_n  # only read where normable

    max_prob = p.amax(dim=-1)
    saturated = (max_prob > threshold).to(dtype)

    i = torch.arange(lq, device=w.device, dtype=dtype).unsqueeze(-1)
    j = torch.arange(lk, device=w.device, dtype=dtype).unsqueeze(0)
    distance = (p * (i - j).abs()).sum(dim=-1)

    stats = {
        "entropy": _row_mean(entropy, has_dist),
        "entropy_norm": _row_mean(entropy_norm, has_dist & normable),
        "max_prob": _row_mean(max_prob, has_dist),
        "saturation": _row_mean(saturated, has_dist),
        "attn_distance": _row_mean(distance, has_dist),
        "row_mass": _row_mean(row_mass, valid),
        "support": _row_mean(support, valid),
        "first_mass": _row_mean(w[..., 0], visible[..., 0] & (torch.arange(lq, device=w.device) > 0)),
    }
    if not probability_rows:  # no distribution to read: NaN, so that the columns stay those of any layer
        for name in PROBABILITY_STATS:
            stats[name] = torch.full_like(stats[name], math.nan)
    if signed is None:
        signed = bool((w < 0).any())  # masked entries are 0 here, so only visible weights count
    if signed:
        stats["negative_mass"] = _row_mean((-w).clamp_min(0).sum(dim=-1), valid)

    if logits is not None:
        # Logits keep their own precision (float64 stays float64). Masked entries (possibly -inf or NaN)
        # are replaced by 0 before any arithmetic and never counted.
        ldtype = _work_dtype(logits.dtype)
        s = logits.detach().to(device=w.device, dtype=ldtype)
        maps = s.shape[1] // h
        # k maps per head, component-major: map c of head h is index c*H + h; each map becomes extra batch rows
        s = s.unflatten(1, (maps, h)).transpose(0, 1).reshape(maps * b, h, lq, lk)
        lvisible = visible.repeat(maps, 1, 1, 1)  # row c*B + b is example b, like s
        lzero = torch.zeros((), dtype=ldtype, device=w.device)
        s0 = torch.where(lvisible, s, lzero)
        ln_visible = lvisible.sum(dim=-1)
        n_l = ln_visible.clamp_min(1).to(ldtype)  # rows with no visible key are dropped by _row_mean
        mean = s0.sum(dim=-1, keepdim=True) / n_l.unsqueeze(-1)
        dev = torch.where(lvisible, s0 - mean, lzero)
        std = torch.sqrt((dev * dev).sum(dim=-1) / n_l)
        stats["logit_std"] = _row_mean(std, ln_visible > 0)
        s_max = torch.where(lvisible, s, torch.full_like(s, -math.inf)).amax(dim=(0, 2, 3))
        any_visible = visible.any(dim=-1).any(dim=-1).any(dim=0)
        stats["logit_max"] = torch.where(any_visible, s_max, torch.full_like(s_max, math.nan))

    return stats


def gate_stats(gate: Tensor, keep: Tensor | None = None) -> dict[str, Tensor]:
    """The output gate's values σ(x W_g) (B, H, Lq, 1) headwise or (B, H, Lq, d_v) elementwise, ``keep`` (B, Lq)
    bool (True = a real query row, not padding) or None → ``{"gate_mean": (H,)}``, the mean per head over the kept
    rows and the channels (NaN for a batch with no kept row)."""
    g = gate.detach().to(_work_dtype(gate.dtype)).mean(dim=-1)  # (B, H, Lq)
    if keep is None:
        return {"gate_mean": g.mean(dim=(0, 2))}
    weight = keep.to(g.dtype).unsqueeze(1)  # (B, 1, Lq)
    total = weight.sum() * torch.ones(g.shape[1], dtype=g.dtype, device=g.device)
    return {"gate_mean": (g * weight).sum(dim=(0, 2)) / total}


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
