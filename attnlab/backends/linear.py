"""The ``chunked``, ``recurrent`` and ``global`` backends: linear attention in O(L) (Katharopoulos et al. 2020).

A layer whose score is ``linear`` (φ(q)·φ(k), :class:`~attnlab.scores.LinearScore`) and whose normalizer is
``rowsum`` or ``none`` computes, for each query i over the keys j the mask lets it see,

    out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / (Σ_j φ(q_i)·φ(k_j) + ε)          (without the denominator for ``none``)

which the ``eager`` backend computes from the (Lq, Lk) logits (the reference, and what the diagnostics read: the
effective lower-triangular matrix from v to the output). These backends never form it:

============  ===================================================================================  ================
backend       computes                                                                             masks
============  ===================================================================================  ================
``recurrent`` one token at a time: S_i = S_{i−1} + φ(k_i) v_iᵀ, z_i = z_{i−1} + φ(k_i),             causal
              out_i = φ(q_i) S_i / (φ(q_i)·z_i + ε): the reference of the chunked form, and the
              form that decodes; forced only (a Python loop over L)
``chunked``   chunks of ``chunk_size`` tokens (``attention.backend_params.chunk_size``, default 64):  causal
              within a chunk the masked quadratic form, across chunks the running state S, z
              (exclusive prefix sums over chunks); O(L·C) memory, no (L, L) tensor
``global``    φ(Q) (φ(K)ᵀ V) once, normaliser φ(Q) Σ_j φ(k_j)                                       none, padding
============  ===================================================================================  ================

Key padding (``padding``, ``causal+padding``: a :class:`~attnlab.masks.PreparedMask` whose ``keys`` are recorded)
hides a key by zeroing its features, which is exactly what the masked quadratic form computes. A row that sees no
key gets 0 (0 / ε). Any other mask is refused in one line (``auto`` then chooses ``eager``). Attention dropout on
the weights has no O(L) form: a layer with ``dropout > 0`` trains on ``eager``. In half precision (or under
autocast) the sums run in float32. The chunked form's backward pass
is written by hand (:class:`_CausalLinear`), so it has no second derivative (``create_graph=True``): use ``eager``
or ``recurrent`` for that.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnlab.backends import Backend, Conditions, register_backend
from attnlab.checks import check_int
from attnlab.recurrences import chunked_form, recurrent_form

__all__ = [
    "linear_attention_chunked",
    "linear_attention_global",
    "linear_attention_recurrent",
    "linear_reason",
    "recurrent_step",
]


def recurrent_step(
    state: tuple[Tensor, Tensor] | None,
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    normalize: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One token of causal linear attention, the form that decodes: state (S (B, H, F, D), z (B, H, F)) or None
    (the start), the token's phi_q, phi_k (B, H, F) and v (B, H, D) → (out (B, H, D), the new state):
    S ← S + φ(k) vᵀ, z ← z + φ(k), out = φ(q) S / (φ(q)·z + ε)."""
    if state is None:
        S = phi_q.new_zeros(*phi_q.shape, v.shape[-1])
        z = phi_q.new_zeros(phi_q.shape)
    else:
        S, z = state
    S = S + phi_k.unsqueeze(-1) * v.unsqueeze(-2)  # (B, H, F, D)
    z = z + phi_k
    out = torch.einsum("bhf,bhfd->bhd", phi_q, S)
    if normalize:
        out = out / ((phi_q * z).sum(-1, keepdim=True) + eps)
    return out, (S, z)


def linear_attention_recurrent(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """Causal linear attention one token at a time (:func:`recurrent_step` over the sequence).
    phi_q, phi_k (B, H, L, F), v (B, H, L, D) → (B, H, L, D)."""
    B, H, L, _ = phi_q.shape
    state, outs = None, []
    for i in range(L):
        out, state = recurrent_step(state, phi_q[:, :, i], phi_k[:, :, i], v[:, :, i], normalize, eps)
        outs.append(out)
    return torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1])


def _exclusive_cumsum(t: Tensor, dim: int) -> Tensor:
    """Σ over the entries before each one along ``dim`` (0 for the first)."""
    total = t.cumsum(dim).narrow(dim, 0, t.shape[dim] - 1)
    return torch.cat([torch.zeros_like(t.narrow(dim, 0, 1)), total], dim)


def _causal_chunks(q: Tensor, k: Tensor, v: Tensor, C: int) -> Tensor:
    """The un-normalised causal form o_i = Σ_{j≤i} (q_i·k_j) v_j in chunks of C tokens (L a multiple of C):
    q, k (B, H, L, F), v (B, H, L, D) → (B, H, L, D). Within a chunk the masked quadratic form, across chunks the
    running state Σ k_j v_jᵀ (an exclusive prefix sum over chunks)."""
    B, H, L, Fd = q.shape
    D, N = v.shape[-1], L // C
    if N == 1:  # one chunk: the masked quadratic form alone (no state before it)
        return torch.matmul(torch.matmul(q, k.transpose(-1, -2)).tril_(), v)
    qc, kc, vc = q.view(B, H, N, C, Fd), k.view(B, H, N, C, Fd), v.view(B, H, N, C, D)
    states = _exclusive_cumsum(torch.matmul(kc.transpose(-1, -2), vc), dim=2)  # (B, H, N, F, D): before chunk n
    scores = torch.matmul(qc, kc.transpose(-1, -2)).tril_()  # (B, H, N, C, C): within the chunk, j ≤ i
    return torch.baddbmm(torch.matmul(qc, states).view(-1, C, D), scores.view(-1, C, C), vc.reshape(-1, C, D)).view(
        B, H, L, D
    )


class _CausalLinear(torch.autograd.Function):
    """o = causal_linear(q, k, v), o_i = Σ_{j≤i} (q_i·k_j) v_j, keeping only q, k and v for the backward pass,
    which is three more passes of the same chunked form (nothing of size (C, C) or (F, D) per chunk is kept):

        ∂q_i = Σ_{j≤i} (g_i·v_j) k_j      = causal_linear(g, v, k)
        ∂k_j = Σ_{i≥j} (g_i·v_j) q_i      = reversed causal_linear(v, g, q)
        ∂v_j = Σ_{i≥j} (q_i·k_j) g_i      = reversed causal_linear(k, q, g)
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, chunk: int) -> Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.chunk = chunk
        return _causal_chunks(q, k, v, chunk)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        C = ctx.chunk
        g = g.contiguous()

        def reverse(t: Tensor) -> Tensor:
            return t.flip(2)

        dq = _causal_chunks(g, v, k, C)
        dk = reverse(_causal_chunks(reverse(v), reverse(g), reverse(q), C))
        dv = reverse(_causal_chunks(reverse(k), reverse(q), reverse(g), C))
        return dq, dk, dv, None


def linear_attention_chunked(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, chunk_size: int = 64, normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """Causal linear attention in chunks of ``chunk_size`` tokens. phi_q, phi_k (B, H, L, F), v (B, H, L, D) →
    (B, H, L, D). The sequence is padded with zero features to a multiple of the chunk (they add nothing); the
    normaliser Σ_{j≤i} φ(q_i)·φ(k_j) is the same form with a column of ones beside v."""
    L, D = phi_q.shape[2], v.shape[-1]
    if L == 0:
        return v.new_zeros(*v.shape)
    C = max(1, min(chunk_size, L))
    pad = -L % C
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, L, D + 1)
    if pad:
        phi_q, phi_k, v = (F.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, v))
    out = _CausalLinear.apply(phi_q.contiguous(), phi_k.contiguous(), v.contiguous(), C)[:, :, :L]
    if not normalize:
        return out
    return out[..., :D] / (out[..., D:] + eps)


def linear_attention_global(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """Linear attention with every key visible: φ(Q) (φ(K)ᵀ V). phi_q (B, H, Lq, F), phi_k (B, H, Lk, F),
    v (B, H, Lk, D) → (B, H, Lq, D)."""
    out = torch.matmul(phi_q, torch.matmul(phi_k.transpose(-1, -2), v))  # (B, H, Lq, D)
    if normalize:
        out = out / (torch.matmul(phi_q, phi_k.sum(-2).unsqueeze(-1)) + eps)
    return out


def linear_reason(attn: Any) -> str | None:
    """None when ``attn`` is linear attention that the O(L) backends compute, else the first stage that is not."""
    from attnlab.scores import LinearScore

    if not isinstance(attn.score, LinearScore):
        return f"it computes linear attention only (variant=linear), not {attn.config.score}"
    if not getattr(attn.normalizer, "is_linear", False):
        return f"it normalizes by the row sum or not at all (normalizer=rowsum|none), not {attn.config.normalizer}"
    if attn.position_bias is not None:
        return "it has no position bias"
    if attn.softcap is not None:
        return "it has no soft-capping"
    if attn.differential:
        return "it has no differential attention"
    return None


class _Linear(Backend):
    """Shared by the three: the configuration check, the call check and the inputs."""

    forms: tuple[str, ...] = ()
    recurrent_forms = False
    """whether it also computes the decay and delta-rule forms (:mod:`attnlab.recurrences`)."""

    def config_reason(self, attn: Any) -> str | None:
        if attn.is_recurrent:
            return None if self.recurrent_forms else f"it has no form for variant {attn.config.score} (causal only)"
        return linear_reason(attn)

    def mask_reason(self, form: str, shown: str | None = None) -> str | None:
        if form in self.forms:
            return None
        return f"it computes mask={' or '.join(self.forms)} only, not {shown or form}"

    def call_reason(self, attn: Any, when: Conditions) -> str | None:
        if when.training and attn.dropout > 0:
            return "it has no dropout on the weights (model.dropout > 0 trains on eager)"
        return self.mask_reason(when.mask)

    def inputs(self, attn: Any, x: Tensor, key_value: Tensor | None, mask: Any) -> tuple[Tensor, Tensor, Tensor, Any]:
        """→ φ(q) (B, H, Lq, F), φ(k) (B, H, Lk, F) with hidden keys zeroed, v (B, H, Lk, d_v), the prepared mask."""
        q, k, v = attn.project(x, key_value)
        pm = attn.mask_for_heads(mask, q.shape[2], k.shape[2], x.device)
        form = "none" if pm is None else pm.form
        reason = self.mask_reason(form)
        if reason is not None:
            raise ValueError(f"attention backend {self.name}: {reason}; use backend=eager (or auto) for this mask")
        phi_q, phi_k = attn.score.features(q, attn.expand_heads(k, attn.query_heads))
        if pm is not None and pm.keys is not None:
            phi_k = phi_k * pm.keys.transpose(-1, -2).to(phi_k.dtype)  # (B, 1, Lk, 1): padded keys add nothing
        return phi_q, phi_k, attn.expand_heads(v, attn.num_heads), pm

    def compute(self, attn: Any, phi_q: Tensor, phi_k: Tensor, v: Tensor) -> Tensor:
        raise NotImplementedError

    def compute_recurrent(self, attn: Any, q: Tensor, k: Tensor, v: Tensor, log_alpha: Any, beta: Any) -> Tensor:
        raise NotImplementedError

    def attend(self, attn: Any, x: Tensor, key_value: Tensor | None, mask: Any) -> tuple[Tensor, Tensor | None]:
        if attn.is_recurrent:
            q, k, v, log_alpha, beta, _ = attn.recurrent_inputs(x, key_value, mask)
            inputs: tuple[Any, ...] = (q, k, v, log_alpha, beta)
            compute = self.compute_recurrent
        else:
            inputs = self.inputs(attn, x, key_value, mask)[:3]
            compute = self.compute
        v = inputs[2]
        device = x.device.type
        if v.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(device):
            # the running sums in float32, as the softmax normalizes half-precision logits in float32
            with torch.autocast(device, enabled=False):
                z = compute(attn, *(None if t is None else t.float() for t in inputs))
        else:
            z = compute(attn, *inputs)  # (B, H, Lq, d_v)
        return attn.merge(z.to(v.dtype)), None


def _norm(attn: Any) -> dict[str, Any]:
    return {"normalize": attn.normalizer.normalize_rows, "eps": float(attn.normalizer.eps)}


@register_backend("chunked")
class Chunked(_Linear):
    """Causal linear attention in chunks (:func:`linear_attention_chunked`)."""

    forms = ("causal", "causal+padding")
    recurrent_forms = True
    params: ClassVar[dict[str, Any]] = {"chunk_size": 64}

    def check_params(self, params: dict[str, Any]) -> None:
        if "chunk_size" in params:
            check_int("attention.backend_params.chunk_size", params["chunk_size"], minimum=1)

    def compute(self, attn: Any, phi_q: Tensor, phi_k: Tensor, v: Tensor) -> Tensor:
        return linear_attention_chunked(phi_q, phi_k, v, self.chunk_size(attn), **_norm(attn))

    def chunk_size(self, attn: Any) -> int:
        return int(attn.config.backend_params.get("chunk_size", self.params["chunk_size"]))

    def compute_recurrent(self, attn: Any, q: Tensor, k: Tensor, v: Tensor, log_alpha: Any, beta: Any) -> Tensor:
        return chunked_form(q, k, v, log_alpha, beta, self.chunk_size(attn))


@register_backend("global")
class Global(_Linear):
    """Linear attention with every key visible, or key padding only (:func:`linear_attention_global`)."""

    forms = ("none", "padding")

    def compute(self, attn: Any, phi_q: Tensor, phi_k: Tensor, v: Tensor) -> Tensor:
        return linear_attention_global(phi_q, phi_k, v, **_norm(attn))


@register_backend("recurrent", auto=False)
class Recurrent(_Linear):
    """Causal linear attention one token at a time (:func:`linear_attention_recurrent`): forced only."""

    forms = ("causal", "causal+padding")
    recurrent_forms = True

    def compute(self, attn: Any, phi_q: Tensor, phi_k: Tensor, v: Tensor) -> Tensor:
        return linear_attention_recurrent(phi_q, phi_k, v, **_norm(attn))

    def compute_recurrent(self, attn: Any, q: Tensor, k: Tensor, v: Tensor, log_alpha: Any, beta: Any) -> Tensor:
        return recurrent_form(q, k, v, log_alpha, beta)
