"""What the heads do: head-type scores, rank collapse, dilution, head importance and pruning.

The first three are pure tensor functions of one layer's attention (or hidden states), like
:func:`attnlab.metrics.attention_stats`, and share its conventions: ``weights`` (B, H, Lq, Lk) from any normalizer
(signed for differential attention and the delta rule, unnormalised for linear and decay forms), ``key_mask`` bool
broadcastable to (B, H, Lq, Lk) with True = visible, and every score read on the row's *distribution*
``p_ij = max(w_ij, 0) / sum_j max(w_ij, 0)`` over its visible keys (for softmax, the row itself). A row that sees
no key, or has no positive mass, counts in no average; a head with no counted row gets NaN. The outputs are
detached (H,) tensors, computed in float32 (float64 stays float64).

* :func:`head_scores`: what a head attends to, on a probe of repeated random tokens ``[x; x]``
  (:func:`repeated_tokens`): the previous-token, duplicate-token, induction and local scores.
* :func:`rank_residual`: Dong et al. 2021's rank collapse, ‖X − 1 x̄ᵀ‖_F / ‖X‖_F.
* :func:`dilution`: the weight on the nearest k keys, against a uniform row's (Qin et al. 2022).

The last two need the model: :func:`head_importance` (Michel et al. 2019: |∂L/∂ξ_h| for a gate ξ_h = 1 on each
head, :func:`head_gates`) and :func:`pruning_curve` (the test metric as heads are removed in a given order).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.metrics import _row_mean, _work_dtype, row_distribution

__all__ = [
    "HEAD_SCORES",
    "HEAD_THRESHOLD",
    "HEAD_TYPES",
    "dilution",
    "head_gates",
    "head_importance",
    "head_scores",
    "head_type",
    "importance_order",
    "normalized_importance",
    "pruning_curve",
    "random_order",
    "rank_residual",
    "repeated_tokens",
    "sequence_gates",
]

HEAD_SCORES: tuple[str, ...] = ("prev_token", "duplicate", "induction", "local")
"""The head-type scores :func:`head_scores` returns, in the order :func:`head_type` reads them."""

HEAD_TYPES: dict[str, str] = {
    "prev_token": "previous token",
    "duplicate": "duplicate token",
    "induction": "induction",
    "local": "local",
    "none": "none",
}
"""A head type's name, as the atlas shows it (``none``: no score reaches the threshold)."""

HEAD_THRESHOLD = 0.4
"""The score a head needs for :func:`head_type` to give it that type (and for the atlas's "formed at" step): 0.4 of a
row's weight on one key pattern, about 10 times what a uniform row puts there on a 24-token probe."""


def repeated_tokens(
    num: int, half: int, vocabulary: Sequence[int] | range, generator: torch.Generator | None = None
) -> Tensor:
    """The head-type probe: ``num`` sequences ``[x; x]`` of a random ``x`` of ``half`` tokens, (num, 2·half) long.

    Each ``x`` is drawn from ``vocabulary`` without replacement when it holds at least ``half`` tokens (then every
    token of the second half has exactly one earlier copy, ``half`` positions back), else with replacement."""
    vocab = torch.as_tensor(list(vocabulary), dtype=torch.long)
    if num < 1 or half < 2:
        raise ValueError(f"the repeated-token probe needs num >= 1 and half >= 2, got num={num}, half={half}")
    if vocab.numel() < 2:
        raise ValueError(f"the repeated-token probe needs a vocabulary of at least 2 tokens, got {vocab.numel()}")
    if vocab.numel() >= half:
        picks = torch.stack([torch.randperm(vocab.numel(), generator=generator)[:half] for _ in range(num)])
    else:
        picks = torch.randint(vocab.numel(), (num, half), generator=generator)
    x = vocab[picks]  # (num, half)
    return torch.cat([x, x], dim=1)


@torch.no_grad()
def head_scores(weights: Tensor, tokens: Tensor, key_mask: Tensor | None = None, window: int = 2) -> dict[str, Tensor]:
    """Per-head head-type scores of one self-attention layer on a token probe.

    Each score is the mean, over the rows where its pattern D has a visible key, of the weight the row's
    distribution p puts on the pattern, Σ_j p_ij D_ij: TransformerLens's head detector (``error_measure="mul"``,
    Σ A⊙D / Σ A, for rows that sum to 1) with Olsson et al. 2022's choice of rows (on ``[x; x]``, the second half
    for the duplicate and induction scores), so that a head that does exactly this scores 1.

    * ``prev_token``: D_ij = [j = i − 1], rows i ≥ 1.
    * ``duplicate``: D_ij = [t_j = t_i, j < i], the earlier copies of the current token.
    * ``induction``: D_ij = [t_{j−1} = t_i, j ≤ i], the token after an earlier copy of the current token.
    * ``local``: D_ij = [|i − j| ≤ window], every row (a previous-token head is local too: :func:`head_type` names
      the specific types first).

    Args:
        weights: (B, H, L, L) self-attention weights.
        tokens: (B, L) the token ids (with no padding token among them; a masked key never counts).
        key_mask: bool broadcastable to (B, H, L, L), True = visible; None = every key.
        window: the local score's half-width w >= 0.

    Returns:
        ``{score: (H,)}`` for the names of :data:`HEAD_SCORES`; NaN for a head with no row where the pattern exists.
    """
    if weights.shape[-1] != weights.shape[-2] or tokens.shape != (weights.shape[0], weights.shape[-1]):
        raise ValueError(
            f"head_scores needs self-attention weights (B, H, L, L) and tokens (B, L), got {tuple(weights.shape)} "
            f"and {tuple(tokens.shape)}"
        )
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    _, visible, p, rows = row_distribution(weights, key_mask)
    L = weights.shape[-1]
    i = torch.arange(L, device=p.device)
    t = tokens.to(p.device)
    earlier = i[None, :] < i[:, None]  # (L, L): j < i
    same = t[:, :, None] == t[:, None, :]  # (B, L, L): t_i = t_j
    shifted = torch.zeros_like(same)
    shifted[:, :, 1:] = same[:, :, :-1]  # [t_i = t_{j−1}]
    patterns = {
        "prev_token": (i[None, :] == i[:, None] - 1)[None],  # (1, L, L)
        "duplicate": same & earlier,
        "induction": shifted & (i[None, :] <= i[:, None]),
        "local": ((i[None, :] - i[:, None]).abs() <= window)[None],
    }
    out = {}
    for name, pattern in patterns.items():
        d = pattern[:, None] & visible  # (B, H, L, L)
        on = torch.where(d, p, torch.zeros((), dtype=p.dtype, device=p.device)).sum(dim=-1)
        out[name] = _row_mean(on, rows & d.any(dim=-1))
    return out


def head_type(scores: dict[str, float], threshold: float = HEAD_THRESHOLD) -> tuple[str, float]:
    """The type of one head from its scores (``{name: value}`` of :data:`HEAD_SCORES`) and the score that names it:
    the highest of the previous-token, duplicate and induction scores when it reaches ``threshold``; else ``local``
    when that score does (a previous-token head is local too, so the specific types come first); else ``none``, with
    the highest score of all. NaN scores never count."""
    finite = {k: v for k, v in scores.items() if v is not None and math.isfinite(v)}
    specific = {k: finite[k] for k in ("prev_token", "duplicate", "induction") if k in finite}
    if specific:
        name = max(specific, key=specific.__getitem__)
        if specific[name] >= threshold:
            return name, specific[name]
    if finite.get("local", -math.inf) >= threshold:
        return "local", finite["local"]
    return "none", max(finite.values(), default=math.nan)


@torch.no_grad()
def rank_residual(x: Tensor, keep: Tensor | None = None) -> Tensor:
    """Rank collapse (Dong et al. 2021, *Attention is not all you need: pure attention loses rank doubly
    exponentially with depth*): the relative residual ‖X − 1 x̄ᵀ‖_F / ‖X‖_F of each sequence's token
    representations X (n, d) from their mean row x̄, averaged over the sequences. 0 = every token the same (rank 1),
    1 = the tokens average to 0.

    Args:
        x: (B, L, d) token representations.
        keep: (B, L) bool, the tokens that count (not padding); None = all.

    Returns:
        A 0-d tensor; NaN when no sequence has a token with ‖X‖_F > 0.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be (B, L, d), got shape {tuple(x.shape)}")
    h = x.detach().to(_work_dtype(x.dtype))
    k = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device) if keep is None else keep.to(h.device).bool()
    kf = k.unsqueeze(-1).to(h.dtype)  # (B, L, 1)
    count = kf.sum(dim=1).clamp_min(1)  # (B, 1)
    mean = (h * kf).sum(dim=1) / count  # (B, d)
    residual = ((h - mean[:, None]) * kf).square().sum(dim=(1, 2)).sqrt()
    norm = (h * kf).square().sum(dim=(1, 2)).sqrt()
    counted = norm > 0
    ratio = residual / torch.where(counted, norm, torch.ones_like(norm))
    return torch.where(counted, ratio, torch.zeros_like(ratio)).sum() / counted.sum().to(h.dtype)


@torch.no_grad()
def dilution(weights: Tensor, key_mask: Tensor | None = None, near: int = 4) -> dict[str, Tensor]:
    """How much of a row's weight stays near its query, against a uniform row (the "attention dilution" of linear
    attention, Qin et al. 2022, *The Devil in Linear Transformer*).

    A row's nearest ``near`` keys are its visible keys closest to the query by |i − j| (an earlier key first on a
    tie); rows with at most ``near`` visible keys are left out (every key is near). Per head, over the other rows:

    * ``near_mass``: Σ_{j near} p_ij, the weight on the nearest keys;
    * ``locality``: near_mass / (near / n_i), against a uniform row over the row's n_i visible keys: 1 = spread as
      evenly as a uniform row (fully diluted), n_i / near = all on the nearest keys, below 1 = weight kept away.

    Returns ``{"near_mass": (H,), "locality": (H,)}``; NaN for a head with no counted row."""
    if near < 1:
        raise ValueError(f"near must be >= 1, got {near}")
    _, visible, p, rows = row_distribution(weights, key_mask)
    lq, lk = p.shape[-2:]
    i = torch.arange(lq, device=p.device, dtype=p.dtype)[:, None]
    j = torch.arange(lk, device=p.device, dtype=p.dtype)[None, :]
    distance = (i - j).abs() + 0.5 * (j > i).to(p.dtype)  # unique per row: an earlier key wins a tie
    distance = torch.where(visible, distance, torch.full_like(p, math.inf))
    n = visible.sum(dim=-1)  # (B, H, Lq)
    counted = rows & (n > near)
    k = min(near, lk)
    kth = distance.topk(k, dim=-1, largest=False).values[..., -1:]  # the near-th smallest distance
    is_near = visible & (distance <= kth)
    near_mass = torch.where(is_near, p, torch.zeros((), dtype=p.dtype, device=p.device)).sum(dim=-1)
    locality = near_mass * n.to(p.dtype) / near
    return {"near_mass": _row_mean(near_mass, counted), "locality": _row_mean(locality, counted)}


# ---------------------------------------------------------------------------------------------------- the model


@contextlib.contextmanager
def head_gates(layers: Iterable[nn.Module], gates: Sequence[Tensor] | Tensor) -> Iterator[None]:
    """Multiply each attention head's output by a gate for the block: head h of layer l contributes
    ξ_lh · z_lh W_O (Michel et al. 2019's ξ; 0 removes the head, 1 changes nothing). ``layers``: the encoder's
    layers (:class:`~attnlab.encoder.EncoderLayer`, or the attention modules themselves); ``gates``: one (H,) tensor
    per layer (or a (layers, H) tensor). Every backend applies the gate, in :meth:`MultiHeadAttention.merge`."""
    modules = [getattr(layer, "self_attn", layer) for layer in layers]
    if len(gates) != len(modules):
        raise ValueError(f"head_gates: {len(gates)} gate vectors for {len(modules)} layers")
    for module, gate in zip(modules, gates, strict=True):
        if gate.shape != (module.num_heads,):
            raise ValueError(
                f"head_gates: a layer with {module.num_heads} heads got gates of shape {tuple(gate.shape)}"
            )
    before = [module.head_gate for module in modules]
    try:
        for module, gate in zip(modules, gates, strict=True):
            module.head_gate = gate
        yield
    finally:
        for module, gate in zip(modules, before, strict=True):
            module.head_gate = gate


@contextlib.contextmanager
def sequence_gates(layers: Iterable[nn.Module], gates: Tensor) -> Iterator[None]:
    """Like :func:`head_gates`, with gates of their own for each sequence of the batch: ``gates`` (N, layers, H),
    sequence n of every forward in the block (batches of N sequences) gets ξ = ``gates[n, l]`` on layer l's heads.
    One forward then evaluates N/B gate settings of a batch of B sequences repeated (the pruning curves' points
    together), or gives each of several batches its own gates (per-batch importance in one backward).

    Each head's output is multiplied by its gate where :meth:`MultiHeadAttention.merge` applies ``head_gate``:
    the input of ``out_proj``, (N, Lq, H·d_v), head-major, so the products are the same numbers."""
    modules = [getattr(layer, "self_attn", layer) for layer in layers]
    if gates.dim() != 3 or gates.shape[1] != len(modules):
        raise ValueError(f"sequence_gates: gates must be (N, {len(modules)}, H), got {tuple(gates.shape)}")
    for module in modules:
        if gates.shape[2] != module.num_heads:
            raise ValueError(
                f"sequence_gates: a layer with {module.num_heads} heads got gates of shape {tuple(gates.shape)}"
            )

    def hook_for(layer: int, module: nn.Module) -> Callable[..., Any]:
        per_head = module.d_v  # out_proj's input: the heads' outputs side by side, d_v each

        def hook(_: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            x = args[0]
            if x.shape[0] != gates.shape[0]:
                raise ValueError(f"sequence_gates: gates for {gates.shape[0]} sequences, a batch of {x.shape[0]}")
            g = gates[:, layer].to(device=x.device, dtype=x.dtype).repeat_interleave(per_head, dim=-1)
            return (x * g[:, None, :], *args[1:])

        return hook

    before = [module.head_gate for module in modules]
    handles = []
    try:
        for layer, module in enumerate(modules):
            module.head_gate = None
            handles.append(module.out_proj.register_forward_pre_hook(hook_for(layer, module)))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, gate in zip(modules, before, strict=True):
            module.head_gate = gate


def head_importance(
    layers: Sequence[nn.Module], loss: Callable[[Any], Tensor], batches: Iterable[Any], num_heads: int
) -> Tensor:
    """Head importance (Michel et al. 2019, *Are Sixteen Heads Really Better than One?*, eq. 2): I_h = |∂L/∂ξ_h| at
    ξ = 1, averaged over ``batches`` (the absolute gradient of each batch's mean loss, as their code accumulates it).

    Args:
        layers: the encoder's layers (see :func:`head_gates`).
        loss: a batch → the scalar loss of the model on it (the model in eval mode: no dropout).
        batches: the batches (validation data).
        num_heads: H, the heads of every layer.

    Returns:
        (layers, H) float64; the model's parameters and their gradients are left as they were.
    """
    total = torch.zeros(len(layers), num_heads, dtype=torch.float64)
    count = 0
    for batch in batches:
        gates = torch.ones(len(layers), num_heads, requires_grad=True)
        with head_gates(layers, list(gates.unbind(0))):
            value = loss(batch)
        (grad,) = torch.autograd.grad(value, gates)
        total += grad.detach().abs().double().cpu()
        count += 1
    if count == 0:
        raise ValueError("head_importance needs at least one batch")
    return total / count


def normalized_importance(importance: Tensor) -> Tensor:
    """Each layer's row of (layers, H) importance scores divided by its ℓ2 norm (a layer of zeros stays zero), as
    Michel et al. 2019 do before pruning across layers (§4.2); float64."""
    scores = importance.double()
    norms = torch.linalg.vector_norm(scores, dim=1, keepdim=True)
    return scores / torch.where(norms > 0, norms, torch.ones_like(norms))


def importance_order(importance: Tensor, normalize: bool = True) -> list[tuple[int, int]]:
    """Every head (layer, head) from the least to the most important; ``normalize``: by
    :func:`normalized_importance` first. Ties: by (layer, head)."""
    scores = normalized_importance(importance) if normalize else importance.double()
    heads = [(layer, head) for layer in range(scores.shape[0]) for head in range(scores.shape[1])]
    return sorted(heads, key=lambda lh: (float(scores[lh]), lh))


def random_order(num_layers: int, num_heads: int, seed: int) -> list[tuple[int, int]]:
    """Every head (layer, head) in a random order drawn from ``seed``."""
    perm = torch.randperm(num_layers * num_heads, generator=torch.Generator().manual_seed(seed))
    return [(int(k) // num_heads, int(k) % num_heads) for k in perm]


def pruning_curve(
    layers: Sequence[nn.Module],
    evaluate: Callable[[], dict[str, float]],
    order: Sequence[tuple[int, int]],
    num_heads: int,
) -> list[dict[str, float]]:
    """The metrics as heads are removed (gate 0) in ``order``: point k (0 … len(order)) is ``evaluate()`` with the
    first k heads of ``order`` removed, as ``{"removed": k, **metrics}``. Point 0 gates nothing (every gate 1, which
    leaves the model's output bit for bit as it is)."""
    curve = []
    gates = torch.ones(len(layers), num_heads)
    for k in range(len(order) + 1):
        if k:
            gates[order[k - 1]] = 0.0
        with head_gates(layers, list(gates.clone().unbind(0))):
            point = evaluate()
        curve.append({"removed": k, **point})
    return curve
