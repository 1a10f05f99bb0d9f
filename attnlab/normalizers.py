"""Normalizers: attention logits → weights, the softmax and its alternatives.

A normalizer maps logits ``s`` (B, H, Lq, Lk) and the ``allowed`` mask (bool, broadcastable to (B, H, Lq, Lk),
True = may attend; None = every key visible) to weights ``w`` (B, H, Lq, Lk) with two guarantees, in values and in
gradients: a masked key gets exactly 0, and a row that sees no key gets all zeros, never NaN.

==========  =====================================================  ===========================================
name        w_j                                                    reference
==========  =====================================================  ===========================================
softmax     e^{s_j} / Σ e^{s}                                      the default; the only one SDPA computes
softmax1    e^{s_j} / (1 + Σ e^{s})                                Miller 2023, "attention is off by one"
sink        e^{s_j} / (e^{b_h} + Σ e^{s}), learned b_h per head    the attention sink of gpt-oss (2025)
sigmoid     σ(s_j + b), b = −log n (n visible keys) by default    Ramapuram et al. 2024
sparsemax   [s_j − τ]₊, τ such that Σ w = 1                        Martins & Astudillo 2016
entmax15    [s_j/2 − τ]₊², τ such that Σ w = 1 (α = 1.5)           Peters et al. 2019
softpick    ReLU(e^{s_j} − 1) / (Σ |e^{s} − 1| + ε)                Zuhri et al. 2025
stickbreak… σ(s_j) Π_{k>j} (1 − σ(s_k)), the nearest key first        Tan et al. 2025 (``stickbreaking``)
rowsum      s_j / (Σ s + ε), for non-negative s                    Katharopoulos et al. 2020 (linear attention)
none        s_j (the masked logits, not normalised)                un-normalised linear attention
==========  =====================================================  ===========================================

Register your own with ``@register_normalizer("name")`` on a :class:`Normalizer` subclass (``__init__`` may take
``num_heads`` and any parameters) or on a plain function ``fn(logits, allowed, **params) -> weights``; build one
with ``build_normalizer(name, num_heads=H, **params)``. Sums and maxima are taken over the last dimension (keys).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnlab.checks import check_int, check_number
from attnlab.kernels import sparse as sparse_kernel
from attnlab.kernels import stick as stick_kernel
from attnlab.kernels.rows import RowOp
from attnlab.registry import Registry, check_params

__all__ = [
    "Entmax15",
    "Normalizer",
    "RowSum",
    "Sigmoid",
    "Sink",
    "Softmax",
    "Softmax1",
    "Softpick",
    "Sparsemax",
    "StickBreaking",
    "Unnormalized",
    "build_normalizer",
    "entmax15",
    "list_normalizers",
    "open_empty_rows",
    "register_normalizer",
    "sparsemax",
    "stick_breaking_weights",
]


class Normalizer(nn.Module):
    """Base class: ``forward(logits (B, H, Lq, Lk), allowed bool or None) → weights (B, H, Lq, Lk)``.

    ``is_softmax``: the weights are exactly ``softmax`` of the masked logits, so that attention may hand the whole
    computation to ``scaled_dot_product_attention`` (the fast path). :meth:`extra_logit` not None: the weights are a
    softmax over the keys and one extra logit that is then dropped, which attention also runs in SDPA, with one
    extra key. ``is_linear``: the weights are the masked logits, divided by their row sum plus ``eps`` when
    ``normalize_rows`` (linear attention's ``rowsum``; ``none``), which the O(L) backends compute from features.
    """

    is_softmax: bool = False
    is_linear: bool = False

    def __init__(self) -> None:
        super().__init__()

    def extra_logit(self) -> Tensor | None:
        """The extra logit per head, (H,) or a scalar, of a softmax-with-sink normalizer; None for the others."""
        return None

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


def open_empty_rows(allowed: Tensor) -> tuple[Tensor, Tensor]:
    """(safe, visible) of a bool mask: ``visible`` (…, Lq, 1) is False for a row that sees no key, and ``safe`` is
    ``allowed`` with such rows opened up entirely, so that a normalizer never meets a row of −inf; its output is
    then multiplied by ``visible``."""
    visible = allowed.any(dim=-1, keepdim=True)
    return allowed | ~visible, visible


# --------------------------------------------------------------------------------------------- registry


class FunctionNormalizer(Normalizer):
    """Wraps a registered plain function ``fn(logits, allowed, **params) -> weights``. Parameter-free."""

    def __init__(self, name: str, fn: Callable[..., Tensor], **params: Any) -> None:
        super().__init__()
        self.name, self.fn, self.params = name, fn, params

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        return self.fn(logits, allowed, **self.params)

    def extra_repr(self) -> str:
        return f"{self.name}, {self.params}"


def _wrap_normalizer(name: str, obj: Any, kwargs: dict[str, Any]) -> nn.Module:
    kwargs = dict(kwargs)
    num_heads = kwargs.pop("num_heads", None)
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        sig = inspect.signature(obj)
        check_params("normalizer", name, obj, kwargs, ("num_heads",))
        if "num_heads" in sig.parameters:
            if num_heads is None:
                raise ValueError(f"build_normalizer('{name}') needs num_heads=")
            kwargs["num_heads"] = num_heads
        return obj(**kwargs)
    check_params("normalizer", name, obj, kwargs, ("logits", "allowed"))
    return FunctionNormalizer(name, obj, **kwargs)


_NORMALIZERS: Registry[nn.Module] = Registry("normalizer", _wrap_normalizer)


def register_normalizer(name: str) -> Callable[[Any], Any]:
    """Decorator registering a :class:`Normalizer` subclass or a function ``fn(logits, allowed, **params)``."""
    return _NORMALIZERS.register(name)


def build_normalizer(name: str | nn.Module, num_heads: int | None = None, **params: Any) -> nn.Module:
    """Build the normalizer ``name``: ``build_normalizer("sink", num_heads=4)``. A module is returned as is."""
    if isinstance(name, nn.Module):
        return name
    return _NORMALIZERS.build(name, num_heads=num_heads, **params)


def list_normalizers() -> list[str]:
    """Names of the registered normalizers."""
    return _NORMALIZERS.names()


# --------------------------------------------------------------------------------------------- softmax family


@register_normalizer("softmax")
class Softmax(Normalizer):
    """w = softmax(s) over the visible keys (Bahdanau et al. 2015, Vaswani et al. 2017)."""

    is_softmax = True

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        if allowed is None:
            return torch.softmax(logits, dim=-1)
        safe, visible = open_empty_rows(allowed)
        return torch.softmax(logits.masked_fill(~safe, float("-inf")), dim=-1) * visible


def softmax_with_sink(logits: Tensor, allowed: Tensor | None, sink: Tensor) -> Tensor:
    """e^{s_j} / (e^{sink} + Σ_visible e^{s}): a softmax over the keys and one extra logit ``sink`` (broadcastable
    to (B, H, Lq, 1)) whose weight is dropped. Computed with the row maximum m = max(max_j s_j, sink) taken out
    (held constant in the backward pass: the ratio does not depend on it), so nothing overflows; a row with no
    visible key gives 0 / e^0 = 0."""
    s = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    if s.shape[-1] == 0:  # no key at all (L = 0): amax has nothing to reduce; the weights are empty
        return s.clone()
    m = torch.maximum(s.amax(dim=-1, keepdim=True), sink).detach()  # finite: sink is
    e = torch.exp(s - m)
    return e / (e.sum(dim=-1, keepdim=True) + torch.exp(sink - m))


@register_normalizer("softmax1")
class Softmax1(Normalizer):
    """w_j = e^{s_j} / (1 + Σ e^{s}) (Miller 2023, "attention is off by one"): a sink fixed at logit 0, so that a
    head can attend to nothing (Σ w < 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("zero", torch.zeros(()), persistent=False)  # the sink logit, on the model's device

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        return softmax_with_sink(logits, allowed, self.zero.to(logits.dtype))

    def extra_logit(self) -> Tensor:
        return self.zero


@register_normalizer("sink")
class Sink(Normalizer):
    """w_j = e^{s_j} / (e^{b_h} + Σ e^{s}) with a learned sink logit b_h per head (``sink_logit`` (H,), initialised
    at ``init``, default 0 = softmax1 at the start), joined to every row and then dropped, as in gpt-oss."""

    def __init__(self, num_heads: int, init: float = 0.0) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.sink_logit = nn.Parameter(torch.full((num_heads,), check_number("init", init)))

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        if logits.shape[1] != self.num_heads:
            raise ValueError(f"sink normalizer has {self.num_heads} heads, logits have {logits.shape[1]}")
        return softmax_with_sink(logits, allowed, self.sink_logit.to(logits.dtype).view(1, -1, 1, 1))

    def extra_logit(self) -> Tensor:
        return self.sink_logit

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"


# --------------------------------------------------------------------------------------------- linear


@register_normalizer("rowsum")
class RowSum(Normalizer):
    """w_j = s_j / (Σ_visible s + ε): linear attention's normalisation by the row sum (Katharopoulos et al. 2020,
    eq. 6), for non-negative logits (the ``linear`` score's φ(q)·φ(k)). ``eps`` (default 1e-6, as their code) keeps
    a row whose similarities are all 0 (a row that sees no key) at w = 0.

    ``is_linear``: the weights are the masked logits scaled per row, which the ``chunked``, ``recurrent`` and
    ``global`` backends compute in O(L) from the feature map."""

    is_linear = True
    normalize_rows = True

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = check_number("eps", eps, low=0.0)

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        s = logits if allowed is None else logits.masked_fill(~allowed, 0.0)
        return s / (s.sum(dim=-1, keepdim=True) + self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps:g}"


@register_normalizer("none")
class Unnormalized(Normalizer):
    """w_j = s_j over the visible keys, 0 elsewhere: no normalisation (the un-normalised linear attention that some
    papers pair with a norm on the output). Rows do not sum to 1."""

    is_linear = True
    normalize_rows = False
    eps = 0.0

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        return logits if allowed is None else logits.masked_fill(~allowed, 0.0)


@register_normalizer("sigmoid")
class Sigmoid(Normalizer):
    """w_j = σ(s_j + b) (Ramapuram et al. 2024, "Theory, analysis, and best practices for sigmoid self-attention").

    ``bias``: b; None (default) = −log n with n the number of keys the row sees, the paper's choice, which makes
    Σ w ≈ 1 for logits near 0. Rows do not sum to 1.
    """

    def __init__(self, bias: float | None = None) -> None:
        super().__init__()
        self.bias = None if bias is None else check_number("bias", bias)

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        if self.bias is not None:
            b: Tensor | float = self.bias
        elif allowed is None:
            b = -math.log(max(logits.shape[-1], 1))  # (no key at L = 0: the weights are empty)
        else:
            n = torch.broadcast_to(allowed, logits.shape).sum(dim=-1, keepdim=True)  # visible keys per row
            b = -torch.log(n.clamp(min=1).to(logits.dtype))  # (B, H, Lq, 1)
        w = torch.sigmoid(logits + b)
        return w if allowed is None else w.masked_fill(~allowed, 0.0)

    def extra_repr(self) -> str:
        return "bias=-log n" if self.bias is None else f"bias={self.bias}"


# --------------------------------------------------------------------------------------------- C row kernels


def _kernel_row_op(name: str, **params: Any) -> sparse_kernel.SparseRowOp | None:
    """The C kernel's row operation ``name`` (:mod:`attnlab.kernels.sparse`), or None where it is not built here
    (no compiler, ``ATTNLAB_FUSED_KERNELS=0``)."""
    return sparse_kernel.SparseRowOp(name, **params) if sparse_kernel.available() else None


def _eager_kernel(normalizer: Normalizer, logits: Tensor, allowed: Tensor | None) -> Tensor | None:
    """``normalizer``'s weights (B, H, Lq, Lk) from its C row kernel, out of place and differentiable (once), where
    it has one and the kernel takes these tensors (float32/64 on the CPU, eager); None: use the PyTorch code."""
    op = normalizer.row_op() if sparse_kernel.supports(logits, allowed) else None
    return None if op is None else sparse_kernel.row_normalize(op, logits, allowed)


class _SoftpickFunction(torch.autograd.Function):
    """Softpick over the last dimension, with masked keys (``allowed`` False) at exactly 0, and its closed-form
    backward, in fewer passes over the (…, Lk) tensor than autograd's. With e_j = (e^{s_j} − 1)·e^{−m} (0 for a
    masked key), D = Σ|e| + ε·e^{−m} and w = ReLU(e)/D:
        ∂L/∂s_j = (e_j + e^{−m}) / D · (1[e_j > 0]·g_j − sign(e_j)·Σ_i g_i w_i).
    m is held constant: the ratio does not depend on it."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, allowed: Tensor | None, eps: float) -> Tensor:
        if allowed is None:
            m = logits.amax(dim=-1, keepdim=True).clamp_(min=0)
            e = logits - m
        else:
            e = logits.masked_fill(~allowed, float("-inf"))
            m = e.amax(dim=-1, keepdim=True).clamp_(min=0)
            e.sub_(m)
        shift = torch.exp(-m)
        e.exp_().sub_(shift)  # (e^s − 1)·e^{−m}
        if allowed is not None:
            e.masked_fill_(~allowed, 0.0)
        w = e.clamp(min=0)
        denom = 2 * w.sum(dim=-1, keepdim=True) - e.sum(dim=-1, keepdim=True) + eps * shift  # Σ|e| = Σ(2·ReLU(e) − e)
        w.div_(denom)
        u = e.add_(shift).div_(denom)  # e^{s−m} / D, 0 for a masked key
        if allowed is not None:
            u.masked_fill_(~allowed, 0.0)
        ctx.save_for_backward(u, w, shift / denom)
        return w

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        u, w, cut = ctx.saved_tensors  # e_j > 0 ⟺ u_j > e^{−m}/D = cut; e_j = 0 ⟺ u_j = cut (s_j = 0)
        gw = (grad * w).sum(dim=-1, keepdim=True)
        inner = torch.where(u > cut, grad - gw, gw)
        return inner.masked_fill_(u == cut, 0.0).mul_(u), None, None


@register_normalizer("softpick")
class Softpick(Normalizer):
    """w_j = ReLU(e^{s_j} − 1) / (Σ_visible |e^{s} − 1| + ε) (Zuhri et al. 2025, "Softpick: no attention sink, no
    massive activations with rectified softmax"). Keys with s ≤ 0 get exactly 0, and rows sum to at most 1.

    Computed as ReLU(e^{s−m} − e^{−m}) / (Σ |e^{s−m} − e^{−m}| + ε·e^{−m}) with m = max(max_j s_j, 0), the same
    ratio multiplied through by e^{−m}, so that nothing overflows; the backward pass is written out
    (:class:`_SoftpickFunction`). On the CPU (float32/64, eager) by the C row kernel of
    :mod:`attnlab.kernels.sparse` where it is built (:meth:`row_op`), else by that PyTorch code.
    """

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = check_number("eps", eps, low=0.0, low_open=True)

    def row_op(self) -> RowOp | None:
        """The C kernel's softpick as a :class:`~attnlab.kernels.rows.RowOp`, or None where it is not built."""
        return _kernel_row_op("softpick", eps=self.eps)

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        fast = _eager_kernel(self, logits, allowed)
        return fast if fast is not None else _SoftpickFunction.apply(logits, allowed, self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


# --------------------------------------------------------------------------------------------- sparse: α-entmax


def _sparsemax_threshold(zs: Tensor) -> tuple[Tensor, Tensor]:
    """Rows sorted in descending order (all of a row, or its top k) → (τ, support size), both (…, 1)."""
    k = torch.arange(1, zs.shape[-1] + 1, device=zs.device, dtype=zs.dtype)
    cumsum = zs.cumsum(dim=-1) - 1
    support = (k * zs > cumsum).sum(dim=-1, keepdim=True)  # k(z) ≥ 1
    return cumsum.gather(-1, support - 1) / support.to(zs.dtype), support


def _entmax15_threshold(zs: Tensor) -> tuple[Tensor, Tensor]:
    """Rows sorted in descending order (all of a row, or its top k) → (τ, support size), both (…, 1)."""
    rho = torch.arange(1, zs.shape[-1] + 1, device=zs.device, dtype=zs.dtype)
    mean = zs.cumsum(dim=-1) / rho
    mean_sq = (zs * zs).cumsum(dim=-1) / rho
    ss = rho * (mean_sq - mean * mean)
    delta = ((1 - ss) / rho).clamp(min=0)
    tau = mean - delta.sqrt()
    support = (tau <= zs).sum(dim=-1, keepdim=True)
    return tau.gather(-1, support - 1), support


def _threshold(z: Tensor, find: Callable[[Tensor], tuple[Tensor, Tensor]], k: int = 64) -> Tensor:
    """τ of each row of z (…, n), exactly as from the fully sorted row, but from its top k values where that
    suffices: the support is a prefix of the sorted row, so a support smaller than k found among the top k is the
    row's support. Rows whose support reaches k are done again with 2k, up to a full sort."""
    n = z.shape[-1]
    flat = z.reshape(-1, n)
    tau = flat.new_empty(flat.shape[0], 1)
    rows = torch.arange(flat.shape[0], device=z.device)
    while rows.numel():
        k = min(k, n)
        part = flat if rows.numel() == flat.shape[0] else flat[rows]
        top = part.topk(k, dim=-1).values if k < n else part.sort(dim=-1, descending=True).values
        t, support = find(top)
        done = (support < k).squeeze(-1) if k < n else torch.ones_like(rows, dtype=torch.bool)
        tau[rows[done]] = t[done]
        rows, k = rows[~done], 2 * k
    return tau.view(*z.shape[:-1], 1)


class _EntmaxFunction(torch.autograd.Function):
    """Exact α-entmax over the last dimension for α = 2 (sparsemax; Martins & Astudillo 2016, Alg. 1) and α = 1.5
    (Peters et al. 2019, Alg. 2), with τ found as from the sorted row (:func:`_threshold`), masked keys and rows
    that see no key at exactly 0, and the closed-form backward, in place where it can be:

    * α = 2:   p = [s − τ]₊,        ∂L/∂s = 1_S ⊙ (g − mean_{j∈S} g_j), S the support;
    * α = 1.5: p = [s/2 − τ]₊² = u², ∂L/∂s = u ⊙ g − u · Σ u g / Σ u.

    The row maximum is taken out first (held constant: τ moves with it) and masked keys are −inf, which falls
    outside every support.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, allowed: Tensor | None, alpha: float) -> Tensor:
        if allowed is None:
            z, visible = logits - logits.amax(dim=-1, keepdim=True), None
        else:
            safe, visible = open_empty_rows(allowed)
            z = logits.masked_fill(~safe, float("-inf"))
            z.sub_(z.amax(dim=-1, keepdim=True))
        if alpha == 1.5:
            z.mul_(0.5)
        find = _sparsemax_threshold if alpha == 2 else _entmax15_threshold
        p = z.sub_(_threshold(z, find)).clamp_(min=0)  # p for α = 2, u = √p for α = 1.5
        if visible is not None:
            p.mul_(visible)
        ctx.alpha = alpha
        ctx.save_for_backward(p)
        return p if alpha == 2 else p.square()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (p,) = ctx.saved_tensors
        if ctx.alpha == 2:
            support = (p > 0).to(grad.dtype)
            gs = grad * support
            mean = gs.sum(dim=-1, keepdim=True) / support.sum(dim=-1, keepdim=True).clamp(min=1)
            return gs.sub_(support.mul_(mean)), None, None
        gu = grad * p  # p is u here
        q = gu.sum(dim=-1, keepdim=True) / p.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
        return gu.sub_(p * q), None, None


def sparsemax(logits: Tensor, allowed: Tensor | None = None) -> Tensor:
    """sparsemax(s) = argmin_{p ∈ Δ} ‖p − s‖² = [s − τ]₊ over the visible keys of the last dimension."""
    return _EntmaxFunction.apply(logits, allowed, 2.0)


def entmax15(logits: Tensor, allowed: Tensor | None = None) -> Tensor:
    """1.5-entmax(s) = [s/2 − τ]₊² over the visible keys of the last dimension (Peters et al. 2019)."""
    return _EntmaxFunction.apply(logits, allowed, 1.5)


@register_normalizer("sparsemax")
class Sparsemax(Normalizer):
    """w = [s − τ]₊ with τ such that Σ w = 1 (Martins & Astudillo 2016): the Euclidean projection of the logits on
    the simplex. Exact, with exact zeros outside its support: on the CPU (float32/64, eager) by the C row kernel of
    :mod:`attnlab.kernels.sparse` where it is built (:meth:`row_op`), else sort-based (:func:`sparsemax`)."""

    def row_op(self) -> RowOp | None:
        """The C kernel's sparsemax as a :class:`~attnlab.kernels.rows.RowOp`, or None where it is not built."""
        return _kernel_row_op("sparsemax")

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        fast = _eager_kernel(self, logits, allowed)
        return fast if fast is not None else sparsemax(logits, allowed)


@register_normalizer("entmax15")
class Entmax15(Normalizer):
    """1.5-entmax (Peters et al. 2019): w = [s/2 − τ]₊² with τ such that Σ w = 1, between softmax (α = 1) and
    sparsemax (α = 2). Exact, with exact zeros outside its support: on the CPU (float32/64, eager) by the C row
    kernel of :mod:`attnlab.kernels.sparse` where it is built (:meth:`row_op`), else sort-based (:func:`entmax15`)."""

    def row_op(self) -> RowOp | None:
        """The C kernel's 1.5-entmax as a :class:`~attnlab.kernels.rows.RowOp`, or None where it is not built."""
        return _kernel_row_op("entmax15")

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        fast = _eager_kernel(self, logits, allowed)
        return fast if fast is not None else entmax15(logits, allowed)


# --------------------------------------------------------------------------------------------- stick-breaking


def stick_breaking_weights(logits: Tensor, allowed: Tensor | None = None, attend_current: bool = False) -> Tensor:
    """Stick-breaking attention's weights (Tan et al. 2025, eq. 3) in PyTorch, in log space: logits (B, H, Lq, Lk),
    allowed bool broadcastable or None → w (B, H, Lq, Lk), w_j = σ(s_j) Π_{k ∈ K, k > j} (1 − σ(s_k)) over the keys K
    the row sees (allowed, and not the query's own key i + Lk − Lq unless ``attend_current``), as
    exp(log σ(s_j) + Σ_{k > j} log σ(−s_k)) with the sum a reversed cumulative sum (no product underflows). The
    reference of :mod:`attnlab.kernels.stick`, and what runs where the kernel does not (CUDA, bf16, compile, the
    FLOP counter)."""
    Lq, Lk = logits.shape[-2:]
    visible = torch.ones(Lq, Lk, dtype=torch.bool, device=logits.device)
    if not attend_current:
        own = torch.arange(Lq, device=logits.device)[:, None] + (Lk - Lq)
        visible = visible & (torch.arange(Lk, device=logits.device)[None, :] != own)
    if allowed is not None:
        visible = visible & allowed
    z = torch.where(visible, logits, logits.new_zeros(()))
    rest = torch.where(visible, -torch.nn.functional.softplus(z), logits.new_zeros(()))  # log(1 − σ(s_k))
    after = rest.flip(-1).cumsum(-1).flip(-1)  # Σ_{k ≥ j}
    after = torch.nn.functional.pad(after[..., 1:], (0, 1))  # Σ_{k > j}
    w = torch.exp(after - torch.nn.functional.softplus(-z))  # σ(s_j) · Π_{k > j} (1 − σ(s_k))
    return torch.where(visible, w, logits.new_zeros(()))


@register_normalizer("stickbreaking")
class StickBreaking(Normalizer):
    """Stick-breaking attention (Tan et al. 2025, "Scaling Stick-Breaking Attention: An Efficient Implementation and
    In-depth Study", ICLR 2025, eq. 3): β_j = σ(s_j), w_j = β_j Π_{k > j} (1 − β_k) over the keys the row sees, the
    nearest first, so each key takes a share of what the nearer keys left. The paper's convention leaves the query's
    own key out (the product and the keys run over j < i; ``attend_current=True`` puts it in, fla's option): under
    a causal mask the first token then sees no key and its output is 0. Rows sum to at most 1; the rest,
    1 − Σ_j w_j = Π_k (1 − β_k), is the row's leftover mass (the diagnostics' ``leftover``). No position encoding is
    needed: the order of the keys is the recency bias.

    Computed in log space: on the CPU (float32/64, eager) by the C kernel of :mod:`attnlab.kernels.stick`
    (:meth:`row_op`: the fused ``normalized`` backend), else by :func:`stick_breaking_weights`."""

    leaves_mass = True
    """rows keep a leftover mass 1 − Σ w that the diagnostics report (``leftover``)."""
    causal_only = True
    """the nearest key first: defined over the keys before the query (Tan et al. 2025), so a layer refuses a
    non-causal mask (:meth:`~attnlab.forms.softmax.SoftmaxForm.check_mask`)."""

    def __init__(self, attend_current: bool = False) -> None:
        super().__init__()
        if not isinstance(attend_current, bool):
            raise ValueError(f"attend_current must be true or false, got {attend_current!r}")
        self.attend_current = attend_current

    def row_op(self) -> RowOp | None:
        """The C kernel as a :class:`~attnlab.kernels.rows.RowOp`, or None where it is not built."""
        return stick_kernel.StickRowOp(self.attend_current) if stick_kernel.available() else None

    def forward(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        if stick_kernel.supports(logits, allowed):
            return stick_kernel.stick_breaking(logits, allowed, self.attend_current)
        return stick_breaking_weights(logits, allowed, self.attend_current)

    def extra_repr(self) -> str:
        return f"attend_current={self.attend_current}"
