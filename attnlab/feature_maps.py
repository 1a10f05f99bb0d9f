"""Feature maps φ of linear attention: a query or key (B, H, L, d) → features (B, H, L, d_φ), so that the
similarity of q_i and k_j is φ(q_i)·φ(k_j) (Katharopoulos et al. 2020, "Transformers are RNNs").

The ``linear`` score (:class:`~attnlab.scores.LinearScore`, ``variant=linear``) takes one by name
(``variant.params.feature_map=<name>``) and passes it the score's other parameters:

============  ==========================================================  =============  ============================
name          φ(x)                                                        d_φ            paper
============  ==========================================================  =============  ============================
``elu``       elu(x) + 1                                                  d              Katharopoulos et al. 2020
``relu``      max(x, 0)                                                   d              (Qin et al. 2022's ablation)
``taylor``    [1, x/d^¼, vec(x⊗x)/(√2·√d)] on x projected to d = 16     1 + d + d²     Arora et al. 2024 (Based)
``performer`` exp(ω·x' − |x'|²/2)/√m, x' = x/d^¼, m orthogonal ω (FAVOR+)  m              Choromanski et al. 2021
``cosformer`` [relu(x)·cos θ_i, relu(x)·sin θ_i], θ_i = π i / 2M          2d             Qin et al. 2022
``hedgehog``  [softmax(x W + b), softmax(−x W − b)], W per head (I at first)  2d          Zhang et al. 2024
``rebased``   vec(y⊗y), y = γ·norm(x) + β, on x projected to d = 16       d²             Aksenov et al. 2024
============  ==========================================================  =============  ============================

``square`` is another name for ``taylor`` (Based's "2nd-order Taylor" map is often called the squared map).

Register your own with ``@register_feature_map("name")`` on a :class:`FeatureMap` subclass
(``__init__(d_k, num_heads, **params)``, setting ``feature_dim``) or on a plain function
``fn(x, **params) -> features``. A map whose dot products can be negative or zero makes the row-sum normalisation
divide by (almost) zero: the built-in maps give φ(q)·φ(k) ≥ 0 (``taylor``: ≥ ½).

Every map is applied to whole sequences (positions 0 … L−1), so that position-aware maps (``cosformer``) see the
same positions whichever backend computes the layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.checks import check_int
from attnlab.registry import Registry, build_with_sizes, check_params

__all__ = [
    "CosFormer",
    "Elu",
    "FeatureMap",
    "Hedgehog",
    "Performer",
    "ReBased",
    "Relu",
    "Taylor",
    "build_feature_map",
    "list_feature_maps",
    "register_feature_map",
]


class FeatureMap(nn.Module):
    """Base class: ``forward(x (B, H, L, d_k)) → (B, H, L, feature_dim)``.

    Args:
        d_k: the size of the queries and keys it maps.
        num_heads: H (maps with per-head parameters keep one set per head).
    """

    def __init__(self, d_k: int, num_heads: int) -> None:
        super().__init__()
        self.d_k, self.num_heads = d_k, num_heads
        self.feature_dim = d_k

    positional: bool = False
    """the map reads positions 0 … L−1 and takes ``forward(x, length)``: the length of the longer of the query and
    key sequences (cosformer's M)."""

    def step(self) -> None:
        """Called once per training forward of the layer, before the queries and keys are mapped (Performer's
        redraws count these)."""

    def forward(self, x: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, feature_dim={self.feature_dim}"


class FunctionFeatureMap(FeatureMap):
    """Wraps a registered plain function ``fn(x, **params) -> features``; its feature size is found by mapping one
    probe vector."""

    def __init__(self, name: str, fn: Callable[..., Tensor], d_k: int, num_heads: int, **params: Any) -> None:
        super().__init__(d_k, num_heads)
        self.name, self.fn, self.params = name, fn, params
        self.feature_dim = int(fn(torch.ones(1, 1, 1, d_k), **params).shape[-1])

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x, **self.params)


def _wrap(name: str, obj: Any, kwargs: dict[str, Any]) -> nn.Module:
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        kwargs = build_with_sizes("feature map", name, obj, kwargs)
        kwargs.pop("d_v", None)
        return obj(**kwargs)
    kwargs = dict(kwargs)
    d_k, num_heads = kwargs.pop("d_k"), kwargs.pop("num_heads")
    kwargs.pop("d_v", None)
    check_params("feature map", name, obj, kwargs, ("x",))
    return FunctionFeatureMap(name, obj, d_k, num_heads, **kwargs)


_FEATURE_MAPS: Registry[nn.Module] = Registry("feature map", _wrap)


def register_feature_map(name: str) -> Callable[[Any], Any]:
    """Decorator registering a :class:`FeatureMap` subclass or a function ``fn(x, **params) -> features``."""
    return _FEATURE_MAPS.register(name)


def build_feature_map(name: str, d_k: int, num_heads: int, **params: Any) -> FeatureMap:
    """Build the feature map ``name`` for queries and keys of size ``d_k``: ``build_feature_map("elu", 16, 4)``."""
    return _FEATURE_MAPS.build(name, d_k=d_k, num_heads=num_heads, **params)


def list_feature_maps() -> list[str]:
    """Names of the registered feature maps."""
    return _FEATURE_MAPS.names()


def per_head_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x (B, H, L, d) @ w (H, d, a) → (B, H, L, a)."""
    return torch.einsum("bhld,hda->bhla", x, w)


# --------------------------------------------------------------------------------------------- the maps


@register_feature_map("elu")
class Elu(FeatureMap):
    """Katharopoulos et al. 2020: φ(x) = elu(x) + 1 > 0, d_φ = d."""

    def forward(self, x: Tensor) -> Tensor:
        return F.elu(x) + 1


@register_feature_map("relu")
class Relu(FeatureMap):
    """φ(x) = max(x, 0), d_φ = d (the ReLU kernel of Qin et al. 2022's ablations; a query or key with no positive
    coordinate has φ = 0 and sees nothing)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class _Projected(FeatureMap):
    """A map on x projected to ``feature_dim`` per head (a learned (H, d_k, feature_dim) matrix, N(0, 1/d_k)),
    or on x itself when ``feature_dim`` is None or d_k. Based and ReBased project q and k to 16 dimensions
    because their features have d² coordinates."""

    def __init__(self, d_k: int, num_heads: int, feature_dim: int | None = 16) -> None:
        super().__init__(d_k, num_heads)
        d = d_k if feature_dim is None else check_int("feature_dim", feature_dim, minimum=1)
        self.proj = None if d == d_k else nn.Parameter(torch.randn(num_heads, d_k, d) * d_k**-0.5)
        self.d = d

    def project(self, x: Tensor) -> Tensor:
        """x (B, H, L, d_k) → (B, H, L, d)."""
        return x if self.proj is None else per_head_matmul(x, self.proj)


@register_feature_map("taylor")
class Taylor(_Projected):
    """Arora et al. 2024 (Based): the 2nd-order Taylor expansion of exp, φ(x) = [1, x/d^¼, vec(x⊗x)/(√2·√d)],
    so that φ(q)·φ(k) = 1 + q·k/√d + (q·k)²/2d ≥ ½, on x projected to ``feature_dim`` (default 16): d_φ = 1 + d + d².
    """

    def __init__(self, d_k: int, num_heads: int, feature_dim: int | None = 16) -> None:
        super().__init__(d_k, num_heads, feature_dim)
        self.feature_dim = 1 + self.d + self.d**2

    def forward(self, x: Tensor) -> Tensor:
        x = self.project(x)  # (B, H, L, d)
        d = self.d
        outer = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2)  # (B, H, L, d²)
        ones = torch.ones_like(x[..., :1])
        return torch.cat([ones, x * d**-0.25, outer / math.sqrt(2 * d)], dim=-1)  # (B, H, L, 1 + d + d²)


register_feature_map("square")(Taylor)


@register_feature_map("performer")
class Performer(FeatureMap):
    """Choromanski et al. 2021 (Performer, FAVOR+): positive orthogonal random features,
    φ(x) = exp(ω_r·x' − |x'|²/2)/√m for r = 1 … m, x' = x/d^¼, so that E[φ(q)·φ(k)] = exp(q·k/√d), the softmax
    kernel (unbiased; the orthogonal ω lower its variance). ω: blocks of d orthogonal Gaussian directions, each row
    scaled by the norm of a Gaussian vector (so each row is marginally N(0, I)); shared by the heads.

    No stabiliser is subtracted (it would tie a key's features to other positions): ω·x' − |x'|²/2 ≤ |ω|²/2, so
    the features stay finite.

    Args:
        num_features: m (default 64).
        redraw: None (default): ω is drawn once, when the layer is built (from torch's global generator, so from
            the run's seed), and kept in the checkpoint; n: ω is drawn again every n training forwards.
            Draw number i uses a generator seeded with (``seed`` buffer + i), and the draw count is a buffer, so a
            resumed run draws exactly the features the uninterrupted one would have.
    """

    def __init__(self, d_k: int, num_heads: int, num_features: int = 64, redraw: int | None = None) -> None:
        super().__init__(d_k, num_heads)
        self.num_features = self.feature_dim = check_int("num_features", num_features, minimum=1)
        self.redraw = None if redraw is None else check_int("redraw", redraw, minimum=1)
        self.register_buffer("seed", torch.randint(0, 2**31 - 1, ()), persistent=True)
        self.register_buffer("draws", torch.zeros((), dtype=torch.long), persistent=True)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long), persistent=True)
        self.register_buffer("omega", self.draw(0), persistent=True)

    def draw(self, index: int) -> Tensor:
        """The random directions of draw ``index``: (m, d), from a generator seeded with seed + index."""
        gen = torch.Generator().manual_seed(int(self.seed) + index)
        d, m = self.d_k, self.num_features
        blocks = []
        for _ in range(math.ceil(m / d)):
            q, r = torch.linalg.qr(torch.randn(d, d, generator=gen))
            q = q * torch.sign(torch.diagonal(r))  # Haar-uniform: QR's Q alone has sign-biased coordinates
            blocks.append(q.T)  # d orthonormal rows
        directions = torch.cat(blocks)[:m]  # (m, d)
        norms = torch.randn(m, d, generator=gen).norm(dim=1, keepdim=True)  # chi(d): rows marginally N(0, I)
        return directions * norms

    def step(self) -> None:
        if self.redraw is None:
            return
        self.forwards += 1
        if int(self.forwards) % self.redraw == 0:
            self.draws += 1
            self.omega.copy_(self.draw(int(self.draws)))

    def forward(self, x: Tensor) -> Tensor:
        x = x * self.d_k**-0.25
        proj = torch.matmul(x, self.omega.to(x.dtype).T)  # (B, H, L, m)
        return torch.exp(proj - 0.5 * x.pow(2).sum(-1, keepdim=True)) / math.sqrt(self.num_features)

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, num_features={self.num_features}, redraw={self.redraw}"


@register_feature_map("cosformer")
class CosFormer(FeatureMap):
    """Qin et al. 2022 (cosFormer): ReLU features re-weighted by cos(π/2 · (i − j)/M), in its decomposed form
    cos(θ_i − θ_j) = cos θ_i cos θ_j + sin θ_i sin θ_j with θ_i = π i / 2M:
    φ(x_i) = [relu(x_i)·cos θ_i, relu(x_i)·sin θ_i], d_φ = 2d. ``max_len``: M (None: the sequence length L, as
    the paper's M = max(Lq, Lk) for self-attention); positions i − j < M keep a positive weight, and a
    ``max_len`` below the sequence length is refused. With M = L the weights depend on the sequence's length, so
    a decoder, or a model tested at other lengths, should fix ``max_len``."""

    def __init__(self, d_k: int, num_heads: int, max_len: int | None = None) -> None:
        super().__init__(d_k, num_heads)
        self.max_len = None if max_len is None else check_int("max_len", max_len, minimum=1)
        self.feature_dim = 2 * d_k

    positional = True

    def forward(self, x: Tensor, length: int | None = None) -> Tensor:
        """x (B, H, L, d) → (B, H, L, 2d); ``length``: the M to use when ``max_len`` is None (default L; the
        ``linear`` score passes max(Lq, Lk))."""
        L = x.shape[-2]
        M = self.max_len or length or L
        if self.max_len is not None and max(L, length or 0) > self.max_len:
            raise ValueError(
                f"cosformer max_len ({self.max_len}) must be at least the sequence length ({max(L, length or 0)}): "
                "beyond it the cosine weights turn negative"
            )
        theta = (math.pi / (2 * M)) * torch.arange(L, device=x.device, dtype=x.dtype)[:, None]  # (L, 1)
        r = F.relu(x)
        return torch.cat([r * torch.cos(theta), r * torch.sin(theta)], dim=-1)  # (B, H, L, 2d)


@register_feature_map("hedgehog")
class Hedgehog(FeatureMap):
    """Zhang et al. 2024 (Hedgehog): a learned map φ(x) = [softmax(x W + b), softmax(−(x W + b))], each softmax
    over its d features (as their code's ``SoftmaxDim``), with one W (d, d) and b (d,) per head, W initialised to
    the identity and b to 0 (so that φ starts as a spiky, exp-like kernel), d_φ = 2d."""

    def __init__(self, d_k: int, num_heads: int) -> None:
        super().__init__(d_k, num_heads)
        self.weight = nn.Parameter(torch.eye(d_k).repeat(num_heads, 1, 1))  # (H, d, d)
        self.bias = nn.Parameter(torch.zeros(num_heads, 1, d_k))  # (H, 1, d)
        self.feature_dim = 2 * d_k

    def forward(self, x: Tensor) -> Tensor:
        wx = per_head_matmul(x, self.weight) + self.bias  # (B, H, L, d)
        return torch.cat([torch.softmax(wx, dim=-1), torch.softmax(-wx, dim=-1)], dim=-1)  # (B, H, L, 2d)


@register_feature_map("rebased")
class ReBased(_Projected):
    """Aksenov et al. 2024 (ReBased): a learnable, normalised quadratic kernel, φ(x) = vec(y⊗y) with
    y = γ ⊙ norm(x) + β (norm: zero mean, unit variance over the features; γ = 1, β = 0 at the start, per head),
    so that φ(q)·φ(k) = (y_q·y_k)² ≥ 0, on x projected to ``feature_dim`` (default 16): d_φ = d²."""

    def __init__(self, d_k: int, num_heads: int, feature_dim: int | None = 16) -> None:
        super().__init__(d_k, num_heads, feature_dim)
        self.gamma = nn.Parameter(torch.ones(num_heads, 1, self.d))
        self.beta = nn.Parameter(torch.zeros(num_heads, 1, self.d))
        self.feature_dim = self.d**2

    def forward(self, x: Tensor) -> Tensor:
        x = self.project(x)
        y = self.gamma * F.layer_norm(x, (self.d,)) + self.beta  # (B, H, L, d)
        return (y.unsqueeze(-1) * y.unsqueeze(-2)).flatten(-2)  # (B, H, L, d²)
