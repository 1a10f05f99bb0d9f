"""Position biases: additive logit terms that attention adds to any score (Shaw 2018, T5 buckets, ALiBi).

A position bias is a :class:`PositionBias` registered with ``@register_position_bias("name")`` and built with
``build_position_bias(name, d_k=..., num_heads=..., **params)``: ``bias(q, num_keys)`` returns an additive
(…, H, Lq, Lk) term, already scaled, that :class:`~attnlab.attention.MultiHeadAttention` adds to the score's
logits (the additive score's too), and an optional value-side term (Shaw's a^V). A bias that can say its value at
one (batch, head, query, key) from a few small tensors offers it as a FlexAttention ``score_mod``
(:meth:`PositionBias.score_mod`: Shaw, T5, ALiBi), which the ``flex`` backend (:mod:`attnlab.backends.flex`) fuses
into one kernel. The variants ``alibi``, ``t5_bias``
and ``relative_position`` are presets (:func:`attnlab.scores.register_preset`): a score plus one of these biases.

Positions are 0-based; for self-attention query i and key j are the same sequence positions.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.checks import check_int
from attnlab.kernels import relative as relative_kernel
from attnlab.kernels.tiled import OffsetTable
from attnlab.registry import BoundedCache, Registry, build_with_sizes, registry_of

__all__ = [
    "AlibiBias",
    "PositionBias",
    "ScoreMod",
    "ShawBias",
    "T5Bias",
    "alibi_slopes",
    "build_position_bias",
    "list_position_biases",
    "register_position_bias",
    "resolve_direction",
    "t5_relative_bucket",
]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""A FlexAttention ``score_mod``: (score, b, h, q_idx, kv_idx) → the modified score, all 0-d tensors."""


def _clipped_distance_mod(qa: Tensor, clip: int) -> ScoreMod:
    """score + qa[b, h, q, clip(k − q, ±clip) + clip] for qa (B, H, Lq, 2·clip + 1): Shaw's a^K."""

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + qa[b, h, q_idx, (kv_idx - q_idx).clamp(-clip, clip) + clip]

    return mod


def _offset_table_mod(table: Tensor, num_queries: int) -> ScoreMod:
    """score + table[h, k − q + Lq − 1] for a per-head table (H, Lq + Lk − 1) over the offsets k − q: T5."""

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + table[h, kv_idx - q_idx + (num_queries - 1)]

    return mod


def _slope_mod(slopes: Tensor) -> ScoreMod:
    """score − slopes[h]·|k − q| for slopes (H,): ALiBi."""

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score - slopes[h] * (kv_idx - q_idx).abs()

    return mod


# --------------------------------------------------------------------------------------------- position biases


class PositionBias(nn.Module):
    """Base class of position biases: ``bias(q, num_keys)`` → an additive (…, H, Lq, Lk) logit term, already
    scaled, that attention adds to the score's logits. It may read q (Shaw) or only positions (T5, ALiBi).

    ``has_value_term`` / :meth:`value_term`: as for scores (Shaw's a^V). ``static_bias``: the bias depends on
    positions only and ``bias`` returns the same cached tensor for the same shapes (ALiBi), so that the fast path
    may cache its combination with a cached mask.
    """

    has_value_term: bool = False
    static_bias: bool = False

    def __init__(self, d_k: int, num_heads: int, d_v: int | None = None) -> None:
        super().__init__()
        self.d_k = d_k
        self.num_heads = num_heads
        self.d_v = d_k if d_v is None else d_v
        self._tables = BoundedCache()

    def bias(self, q: Tensor, num_keys: int) -> Tensor:  # pragma: no cover - abstract
        """q (B, H, Lq, d_k) → additive logits broadcastable to (B, H, Lq, Lk)."""
        raise NotImplementedError

    def table_bias(self, q: Tensor, num_keys: int) -> tuple[Tensor, relative_kernel.Runs] | None:
        """The bias as a table read through a relative-position index, for the fused kernel of
        :mod:`attnlab.kernels.relative`: (table, runs of the (Lq, Lk) column index), the table (B, H, Lq, C) (a row
        per query) or (H, C) (a row per head), such that ``bias[…, i, j] = table[row, c(i, j)]``; None (default)
        when the bias is not of that form."""
        return None

    def offset_table(self, q: Tensor, num_keys: int) -> OffsetTable | None:
        """The bias as a table read at the offset j − i, for the tiled kernel (:mod:`attnlab.kernels.tiled`, the
        ``tiled`` backend): an :class:`~attnlab.kernels.tiled.OffsetTable` with ``bias[b, h, i, j] = table[b, h, i,
        clamp(j − i, low, high) − low]`` (per head over every offset: T5, ALiBi; per query row, clipped: Shaw's
        q · w^K), computed here from q (B, H, Lq, d_k) with its gradient. It must add exactly what :meth:`bias`
        gives. None (default): no such form; the ``tiled`` backend then refuses a layer with this bias."""
        return None

    @property
    def has_offset_table(self) -> bool:
        """Whether this bias offers :meth:`offset_table` (its class overrides it)."""
        return type(self).offset_table is not PositionBias.offset_table

    def score_mod(self, q: Tensor, num_keys: int) -> ScoreMod | None:
        """The bias as a FlexAttention ``score_mod`` (the optional hook of the ``flex`` backend,
        :mod:`attnlab.backends.flex`): a function ``mod(score, b, h, q_idx, kv_idx) -> score + bias[b, h, q_idx,
        kv_idx]`` on 0-d tensors (b the batch, h the query head, q_idx and kv_idx positions), reading only tensors
        computed here from q (B, H, Lq, d_k) and captured by the function (Shaw's q·w^K (B, H, Lq, 2k + 1), T5's
        per-offset table (H, Lq + Lk − 1), ALiBi's slopes (H,)). It must add exactly what :meth:`bias` gives.

        None (default): no such form; the ``flex`` backend then refuses a layer with this bias (a subclass that
        overrides this method but returns None at some shape gets its bias materialised and read by index there).
        Build ``mod`` from a module-level function of the captured tensors (as below), so that ``torch.compile``
        sees the same code for every call and recompiles only when a shape changes."""
        return None

    @property
    def has_score_mod(self) -> bool:
        """Whether this bias offers :meth:`score_mod` (its class overrides it)."""
        return type(self).score_mod is not PositionBias.score_mod

    def value_term(self, weights: Tensor) -> Tensor | None:
        """weights (B, H, Lq, Lk) → extra output (B, H, Lq, d_v) added to ``weights @ v``, or None."""
        return None

    def forward(self, q: Tensor, num_keys: int) -> Tensor:
        return self.bias(q, num_keys)

    def relative_positions(self, num_queries: int, num_keys: int, device: torch.device) -> Tensor:
        """(Lq, Lk) long tensor of key − query positions, cached."""

        def make() -> Tensor:
            i = torch.arange(num_queries, device=device)
            j = torch.arange(num_keys, device=device)
            return j[None, :] - i[:, None]

        return self._tables.get_or_make(("rel", num_queries, num_keys, device), make)

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, num_heads={self.num_heads}"


def _wrap_bias(name: str, obj: Any, kwargs: dict[str, Any]) -> nn.Module:
    if not (isinstance(obj, type) and issubclass(obj, PositionBias)):
        raise TypeError(f"position bias '{name}' must be registered on a PositionBias subclass, got {obj!r}")
    return obj(**build_with_sizes("position bias", name, obj, kwargs))


_POSITION_BIASES: Registry[nn.Module] = Registry("position bias", _wrap_bias)


def register_position_bias(name: str) -> Callable[[Any], Any]:
    """Decorator registering a :class:`PositionBias` subclass (``__init__(d_k, num_heads, [d_v], **params)``)."""
    return _POSITION_BIASES.register(name)


def build_position_bias(name: str | None, **kwargs: Any) -> nn.Module | None:
    """Build the position bias ``name``: ``build_position_bias("alibi", d_k=16, num_heads=4)``; ``"none"`` or
    None gives None (no bias)."""
    if name is None or name == "none":
        return None
    return _POSITION_BIASES.build(name, **kwargs)


def list_position_biases() -> list[str]:
    """Names of the registered position biases, and ``none``."""
    return sorted([*_POSITION_BIASES.names(), "none"])


@register_position_bias("shaw")
class ShawBias(PositionBias):
    """Shaw et al. 2018: the bias q_i · a^K_{ij} / √d_k with a^K_{ij} = w^K_{clip(j − i, k)}.

    ``rel_k`` (2·clip + 1, d_k) holds w^K_{−k..k}, shared across heads as in the paper. The bias is computed as
    q · w^Kᵀ over the 2k + 1 distances, then gathered: no (Lq, Lk, d_k) tensor is built.

    ``value_term=True`` adds Shaw's value-side a^V: z_i = Σ_j α_ij (v_j + w^V_{clip(j − i, k)}), with
    ``rel_v`` (2·clip + 1, d_v). Off by default: the paper's ablation found a^K alone sufficient.
    """

    def __init__(
        self, d_k: int, num_heads: int, d_v: int | None = None, clip: int = 16, value_term: bool = False
    ) -> None:
        super().__init__(d_k, num_heads, d_v)
        self.clip = check_int("clip", clip, minimum=0)
        self.scale = d_k**-0.5
        self.has_value_term = bool(value_term)
        self.rel_k = nn.Parameter(torch.randn(2 * clip + 1, d_k) * d_k**-0.5)
        self.rel_v = nn.Parameter(torch.randn(2 * clip + 1, self.d_v) * self.d_v**-0.5) if value_term else None

    def distance_index(self, num_queries: int, num_keys: int, device: torch.device) -> Tensor:
        """(Lq, Lk) long tensor clip(j − i, k) + k ∈ [0, 2k], cached."""
        return self._tables.get_or_make(
            ("idx", num_queries, num_keys, device),
            lambda: self.relative_positions(num_queries, num_keys, device).clamp(-self.clip, self.clip) + self.clip,
        )

    def key_table(self, q: Tensor) -> Tensor:
        """q · w^Kᵀ / √d_k over the 2k + 1 clipped distances: (B, H, Lq, 2k + 1), what every form of the bias reads."""
        return torch.matmul(q, self.rel_k.t() * self.scale)

    def bias(self, q: Tensor, num_keys: int) -> Tensor:
        Lq = q.shape[-2]
        idx = self.distance_index(Lq, num_keys, q.device)  # (Lq, Lk)
        qa = self.key_table(q)  # (B, H, Lq, 2k+1)
        # gather along the last dimension (its backward is one scatter-add; advanced indexing's is 3x slower)
        return torch.gather(qa, -1, idx.expand(*qa.shape[:-1], num_keys))  # (B, H, Lq, Lk)

    def table_bias(self, q: Tensor, num_keys: int) -> tuple[Tensor, relative_kernel.Runs]:
        Lq = q.shape[-2]
        runs = self._tables.get_or_make(
            ("runs", Lq, num_keys), lambda: relative_kernel.Runs(self.distance_index(Lq, num_keys, torch.device("cpu")))
        )
        return self.key_table(q), runs  # (B, H, Lq, 2k+1)

    def offset_table(self, q: Tensor, num_keys: int) -> OffsetTable:
        """q · w^Kᵀ / √d_k (B, H, Lq, 2k + 1), one row per query, read at clip(j − i, k) + k (a^K only)."""
        return OffsetTable.clipped(self.key_table(q), self.clip)

    def score_mod(self, q: Tensor, num_keys: int) -> ScoreMod:
        """score + (q · w^Kᵀ / √d_k)[b, h, q, clip(k − q, k) + k]: the (B, H, Lq, 2k + 1) table that :meth:`bias`
        gathers from, read by index (a^V, the value term, is not part of it)."""
        return _clipped_distance_mod(self.key_table(q), self.clip)

    def value_term(self, weights: Tensor) -> Tensor | None:
        if self.rel_v is None:
            return None
        Lq, Lk = weights.shape[-2:]
        idx = self.distance_index(Lq, Lk, weights.device).expand_as(weights)
        per_distance = weights.new_zeros(*weights.shape[:-1], 2 * self.clip + 1)
        per_distance.scatter_add_(-1, idx, weights)  # (B, H, Lq, 2k+1): Σ of weights at each clipped distance
        return torch.matmul(per_distance, self.rel_v)  # (B, H, Lq, d_v)

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, clip={self.clip}, value_term={self.has_value_term}"


def t5_relative_bucket(
    relative_position: Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucket of each relative position (key − query), Raffel et al. 2020, as in Mesh TensorFlow.

    Half the buckets (per direction when bidirectional) are exact for small distances; the rest grow
    logarithmically up to ``max_distance``, beyond which everything shares the last bucket. With
    ``bidirectional=False`` (causal), keys after the query all fall in bucket 0.
    """
    n = -relative_position
    ret = torch.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        ret = ret + (n < 0).long() * num_buckets
        n = n.abs()
    else:
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = (
        max_exact
        + (
            torch.log(n.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return ret + torch.where(is_small, n, large)


@register_position_bias("t5")
class T5Bias(PositionBias):
    """Raffel et al. 2020 (T5): the bias b_h[bucket(j − i)], a learned scalar per bucket and head.

    ``rel_bias`` (num_buckets, H). ``bidirectional``: separate buckets for keys before and after the query (T5's
    encoder); False puts every later key in bucket 0 and spends all buckets on the past (T5's decoder). None
    (default) is True here; the encoder resolves it to False under a causal mask.
    """

    def __init__(
        self,
        d_k: int,
        num_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool | None = None,
    ) -> None:
        super().__init__(d_k, num_heads)
        self.num_buckets = check_int("num_buckets", num_buckets, minimum=2)
        self.max_distance = check_int("max_distance", max_distance, minimum=2)
        self.bidirectional = True if bidirectional is None else bool(bidirectional)
        self.rel_bias = nn.Parameter(torch.randn(num_buckets, num_heads) * 0.1)

    def buckets(self, num_queries: int, num_keys: int, device: torch.device) -> Tensor:
        """(Lq, Lk) long bucket index, cached."""
        return self._tables.get_or_make(
            ("bucket", num_queries, num_keys, device),
            lambda: t5_relative_bucket(
                self.relative_positions(num_queries, num_keys, device),
                self.bidirectional,
                self.num_buckets,
                self.max_distance,
            ),
        )

    def bias(self, q: Tensor, num_keys: int) -> Tensor:
        Lq = q.shape[-2]
        idx = self.buckets(Lq, num_keys, q.device).view(1, Lq * num_keys)
        # a gather per head row of rel_bias (H, buckets) gives a contiguous (H, Lq·Lk); its backward is one
        # scatter-add (indexing rel_bias[idx] gives (Lq, Lk, H), read strided, and a slower backward)
        table = self.rel_bias.t().to(q.dtype)  # (H, num_buckets)
        return torch.gather(table, 1, idx.expand(self.num_heads, -1)).view(1, self.num_heads, Lq, num_keys)

    def table_bias(self, q: Tensor, num_keys: int) -> tuple[Tensor, relative_kernel.Runs]:
        Lq = q.shape[-2]
        runs = self._tables.get_or_make(
            ("runs", Lq, num_keys), lambda: relative_kernel.Runs(self.buckets(Lq, num_keys, torch.device("cpu")))
        )
        return self.rel_bias.t().to(q.dtype), runs  # (H, num_buckets)

    def offset_buckets(self, num_queries: int, num_keys: int, device: torch.device) -> Tensor:
        """(Lq + Lk − 1,) long: the bucket of each offset k − q = −(Lq − 1) … Lk − 1 (a bucket depends on the offset
        only), cached."""
        return self._tables.get_or_make(
            ("offset_bucket", num_queries, num_keys, device),
            lambda: t5_relative_bucket(
                torch.arange(-(num_queries - 1), num_keys, device=device),
                self.bidirectional,
                self.num_buckets,
                self.max_distance,
            ),
        )

    def offset_table(self, q: Tensor, num_keys: int) -> OffsetTable:
        """b_h[bucket(j − i)] gathered over the offsets −(Lq − 1) … Lk − 1: (H, Lq + Lk − 1), its gradient flowing
        back to the (num_buckets, H) parameter through the gather."""
        Lq = q.shape[-2]
        table = self.rel_bias.t().to(q.dtype)[:, self.offset_buckets(Lq, num_keys, q.device)]
        return OffsetTable.over_offsets(table, Lq, num_keys)

    def score_mod(self, q: Tensor, num_keys: int) -> ScoreMod:
        """score + b_h[bucket(k − q)], read from the per-head table over the offsets (H, Lq + Lk − 1) (the
        (num_buckets, H) parameter gathered once per call, so its gradient flows through the table)."""
        return _offset_table_mod(self.offset_table(q, num_keys).table[0, :, 0], q.shape[-2])  # (H, Lq + Lk − 1)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi head slopes (Press et al. 2022): the geometric sequence 2^(−8/n · h), h = 1..n, for n a power of two.

    Otherwise, the slopes of the closest lower power of two, then every other slope of the next power of two.
    """
    check_int("num_heads", num_heads, minimum=1)

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (h + 1) for h in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(closest)
    if closest != num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


@register_position_bias("alibi")
class AlibiBias(PositionBias):
    """Press et al. 2022 (ALiBi): the bias −m_h · |j − i| with fixed slopes m_h (:func:`alibi_slopes`).

    The paper's causal bias m_h · (j − i) for j ≤ i is extended symmetrically to the bidirectional encoder; under a
    causal mask the two agree.
    """

    static_bias = True

    def __init__(self, d_k: int, num_heads: int) -> None:
        super().__init__(d_k, num_heads)
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)  # float64: exact slopes

    def bias(self, q: Tensor, num_keys: int) -> Tensor:
        Lq = q.shape[-2]

        def make() -> Tensor:
            distance = self.relative_positions(Lq, num_keys, q.device).abs().to(q.dtype)
            return (-self.slopes.to(q.dtype)[:, None, None] * distance).unsqueeze(0)  # (1, H, Lq, Lk)

        return self._tables.get_or_make(("alibi", Lq, num_keys, q.device, q.dtype), make)

    def offset_table(self, q: Tensor, num_keys: int) -> OffsetTable:
        """−m_h·|j − i| over the offsets −(Lq − 1) … Lk − 1: (H, Lq + Lk − 1), cached (no gradient)."""
        Lq = q.shape[-2]

        def make() -> Tensor:
            offsets = torch.arange(-(Lq - 1), num_keys, device=q.device).abs().to(torch.float64)
            return (-self.slopes[:, None] * offsets).to(q.dtype)

        table = self._tables.get_or_make(("alibi_offsets", Lq, num_keys, q.device, q.dtype), make)
        return OffsetTable.over_offsets(table, Lq, num_keys)

    def score_mod(self, q: Tensor, num_keys: int) -> ScoreMod:
        """score − m_h·|k − q| computed in the kernel from the slopes (H,) in q's dtype: no table."""
        return _slope_mod(self.slopes.to(q.dtype))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"


def resolve_direction(
    kind: str, name: str | nn.Module | None, params: Mapping[str, Any] | None, causal: bool
) -> dict[str, Any]:
    """``params`` with ``bidirectional`` set to ``not causal`` when the registered score or position bias ``name``
    (``kind``: ``"score"`` or ``"position bias"``) takes that parameter and it is unset or None: T5's buckets under
    a causal mask are T5's decoder buckets."""
    params = dict(params or {})
    # the scores' registry is read through attnlab.registry: attnlab.scores imports this module (its re-exports and
    # presets), so this one never imports it back
    registry = _POSITION_BIASES if kind == "position bias" else registry_of(kind)
    if registry is None or not isinstance(name, str) or name not in registry or params.get("bidirectional") is not None:
        return params
    if "bidirectional" in inspect.signature(registry.get(name)).parameters:
        params["bidirectional"] = not causal
    return params
