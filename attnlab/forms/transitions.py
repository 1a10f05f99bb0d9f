"""The decay and delta-rule forms: RetNet, gated linear attention, DeltaNet and Gated DeltaNet, each a setting of
one transition record (:class:`~attnlab.transition.Transition`: decay in log space, per head or per key channel;
writing strength β) computed by :mod:`attnlab.transition`:

    M_t = diag(α_t) M_{t−1} + k_t v_tᵀ                        (decay: RetNet, GLA; α ≡ 1 is linear attention)
    M_t = (I − β_t k_t k_tᵀ) diag(α_t) M_{t−1} + β_t k_t v_tᵀ  (delta rule: DeltaNet α ≡ 1, Gated DeltaNet)
    o_t = M_tᵀ q_t

=================  ============================================  ======================  ============  ==========
variant            paper                                         decay α_t               β_t           q, k
=================  ============================================  ======================  ============  ==========
``retnet``         Sun et al. 2023, retention                    γ_h = 1 − 2^(−5−h)      —             k/√d_k
``gla``            Yang et al. 2024 (scalar gate: "simple GLA",   σ(x w_h + b_h)^(1/τ)    —             k/√d_k
                   Mamba-2's SSD, Dao & Gu 2024)
``deltanet``       Schlag et al. 2021; Yang et al. 2024           —                       σ(x w_h + b)  L2-normed
``gated_deltanet`` Yang et al. 2025                               σ(x w_h + b_h)^(1/τ)    σ(x w_h + b)  L2-normed
=================  ============================================  ======================  ============  ==========

with τ = ``gate_normalizer`` (16, GLA's). Each normalises each head's output over d_v before the output projection
(``output_norm``: ``groupnorm``, RetNet's GroupNorm with one group per head, the default of ``retnet``; ``rmsnorm``,
fla's default for the other three; or None). They are causal self-attention only: a layer refuses another mask in
one line. A padded key is written with k = 0, which leaves the state as it was. The weights the diagnostics read are
the effective matrix, the (L, L) lower-triangular map from v to the output (signed for the delta rule).

A new member of the family is one subclass: its :meth:`TransitionForm.gates` (x → log α, β), and
:meth:`TransitionForm.maps` when q and k are mapped otherwise than k/√d_k.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab import transition
from attnlab.checks import check_choice, check_number
from attnlab.config import AttentionConfig
from attnlab.forms.base import Form, FormInputs, FormOutput, LayerSizes, expand_heads, register_form
from attnlab.masks import PreparedMask
from attnlab.normalizers import build_normalizer
from attnlab.transition import Transition

__all__ = [
    "GLA",
    "DeltaNet",
    "GatedDeltaNet",
    "RetNet",
    "TransitionForm",
    "retnet_decays",
]

OUTPUT_NORMS = ("groupnorm", "rmsnorm", None)


def retnet_decays(num_heads: int) -> Tensor:
    """RetNet's multi-scale decays γ_h = 1 − 2^(−5−h), h = 0 … H − 1 (Sun et al. 2023, §2.2), (H,) float64."""
    return 1.0 - 2.0 ** (-5.0 - torch.arange(num_heads, dtype=torch.float64))


class _Gate(nn.Module):
    """A per-head scalar from the input: x (B, L, d_model) → (B, H, L) pre-activations x w_h + b_h (b = 0 at
    first)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, num_heads)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).transpose(1, 2)


class TransitionForm(Form):
    """Base of the decay and delta-rule forms (module docstring). The variant's parameters (``variant.params``,
    ``config.score_params``) are the subclass's keyword arguments.

    Args:
        output_norm: ``groupnorm`` (LayerNorm of each head over d_v, with affine weights: GroupNorm with H groups),
            ``rmsnorm`` (RMSNorm of each head) or None, applied to the output before the output projection.
    """

    tags = frozenset({"recurrent"})
    causal_only = True
    config_fields = frozenset({"score", "score_params", "normalizer"})
    default_output_norm: str | None = "rmsnorm"

    def __init__(self, sizes: LayerSizes, config: AttentionConfig, **params: Any) -> None:
        super().__init__(sizes, config)
        if config.normalizer != "none":
            raise ValueError(
                f"variant {self.name} computes its own weights (a decayed or delta-rule state, no normalizer): "
                f"set normalizer=none (the variant's config does), not normalizer={config.normalizer}"
            )
        for stage, on in (
            ("position_bias", config.position_bias is not None),
            ("softcap", config.softcap is not None),
            ("differential", config.differential),
        ):
            if on:
                raise ValueError(f"variant {self.name} has no form with {stage}: leave {stage} unset for it")
        self.d_model = sizes.d_model
        params = {**config.score_params, **params}
        output_norm = params.pop("output_norm", self.default_output_norm)
        self.output_norm_name = check_choice("output_norm", output_norm, OUTPUT_NORMS)
        if output_norm == "groupnorm":
            self.output_norm: nn.Module | None = nn.LayerNorm(self.d_v)  # per head; weights shared over heads
        elif output_norm == "rmsnorm":
            self.output_norm = nn.RMSNorm(self.d_v, eps=1e-6)
        else:
            self.output_norm = None
        self.normalizer = build_normalizer("none", num_heads=sizes.num_heads)
        allowed = ["output_norm", *(p for p in inspect.signature(self.build).parameters if p != "self")]
        for key in params:
            if key not in allowed:
                raise ValueError(
                    f"variant '{self.name}' does not take parameter '{key}'; allowed: {', '.join(allowed)}"
                )
        self.build(**params)

    def build(self) -> None:
        """The subclass's gates and parameters, from the variant's parameters (its keyword arguments; every form
        also takes ``output_norm``)."""

    def features(self) -> frozenset[str]:
        return frozenset({"form:recurrent"})

    def weights_signed(self) -> bool:
        return True

    # ---------------------------------------------------------------------------------------------- inputs

    def maps(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """The form's own maps of q and k (B, H, L, d_k): k/√d_k by default."""
        return q, k * self.d_k**-0.5

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """x (B, L, d_model) → log α (B, H, L) or (B, H, L, d_k) per key channel, or None; β (B, H, L) or None."""
        return None, None

    def inputs(self, q: Tensor, k: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Transition]:
        """q, k (B, H, L, d_k) and x (B, L, d_model) → the form's q, k and transition record."""
        q, k = self.maps(q, k)
        log_decay, beta = self.gates(x)
        return q, k, Transition(log_decay, beta)

    def prepare(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, mask: PreparedMask | None) -> FormInputs:
        """q (B, H, L, d_k), k, v with their key/value heads repeated for the H heads, the maps and gates applied,
        a padded key zeroed; the mask must be causal (AND key padding)."""
        form = "none" if mask is None else mask.form
        if form == "other" and mask.allowed.shape[:2] == (1, 1):  # a bool tensor: causal if it is exactly j ≤ i
            L = x.shape[1]
            if torch.equal(mask.allowed[0, 0], torch.ones(L, L, dtype=torch.bool, device=x.device).tril()):
                form = "causal"
        if mask is None or form not in ("causal", "causal+padding"):
            raise ValueError(
                f"variant {self.name} is causal only: call it with a causal mask (an attnlab causal Mask, AND key "
                f"padding at most), not mask={form}"
            )
        q, k, step = self.inputs(q, expand_heads(k, self.num_heads), x)
        if mask.keys is not None:
            k = k * mask.keys.transpose(-1, -2).to(k.dtype)  # (B, 1, L, 1): a padded key writes nothing
        return FormInputs(q, k, expand_heads(v, self.num_heads), mask, step)

    # ---------------------------------------------------------------------------------------------- forms

    def parallel(self, inputs: FormInputs, dropout: float = 0.0) -> FormOutput:
        """The effective matrix (:func:`~attnlab.transition.effective_matrix`) as logits and (masked) weights."""
        v, pm = inputs.v, inputs.mask
        logits = transition.effective_matrix(inputs.q, inputs.k, inputs.transition)  # (B, H, L, L)
        low_precision = logits.dtype in (torch.float16, torch.bfloat16)
        weights = self.normalizer(logits.float() if low_precision else logits, pm.allowed).to(v.dtype)
        dropped = F.dropout(weights, dropout) if dropout > 0 else weights
        return FormOutput(torch.matmul(dropped, v), weights, logits)

    def chunked(self, inputs: FormInputs, chunk_size: int) -> Tensor:
        return transition.chunked(inputs.q, inputs.k, inputs.v, inputs.transition, chunk_size)

    def recurrent(self, inputs: FormInputs) -> Tensor:
        return transition.recurrent(inputs.q, inputs.k, inputs.v, inputs.transition)

    def output(self, out: FormOutput) -> Tensor:
        """z (B, H, L, d_v) → each head normalised over d_v (``output_norm``)."""
        return out.z if self.output_norm is None else self.output_norm(out.z)

    # ---------------------------------------------------------------------------------------------- decoding

    def step(self, state: Any, q: Tensor, k: Tensor, v: Tensor, x: Tensor, position: int) -> tuple[Tensor, Any]:
        """The state M (B, H, d_k, d_v), one token (:func:`~attnlab.transition.step`)."""
        q, k, record = self.inputs(q, expand_heads(k, self.num_heads), x)
        v = expand_heads(v, self.num_heads)
        z, state = transition.step(state, q[:, :, 0], k[:, :, 0], v[:, :, 0], record.at(0))
        return z.unsqueeze(2), state  # (B, H, 1, d_v)

    def prefill(
        self, batch: int, length: int, generator: torch.Generator, device: torch.device, dtype: torch.dtype
    ) -> Tensor:
        """M random / d_k (B, H, d_k, d_v)."""
        return (torch.randn(batch, self.num_heads, self.d_k, self.d_v, generator=generator) / self.d_k).to(
            device, dtype
        )

    def state_size(self, length: int) -> int:
        """H·d_k·d_v, whatever the length."""
        return self.num_heads * self.d_k * self.d_v

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, num_heads={self.num_heads}, d_v={self.d_v}, output_norm={self.output_norm_name}"


class _ScalarDecay(TransitionForm):
    """GLA's scalar decay per head, shared by ``gla`` and ``gated_deltanet``: log α_t = log σ(x_t w_h + b_h) / τ
    (τ = ``gate_normalizer``), in log space."""

    def build_decay(self, gate_normalizer: float) -> None:
        self.gate_normalizer = check_number("gate_normalizer", gate_normalizer, low=1.0)
        self.alpha_gate = _Gate(self.d_model, self.num_heads)

    def log_alpha(self, x: Tensor) -> Tensor:
        """x (B, L, d_model) → log α (B, H, L) ≤ 0."""
        return F.logsigmoid(self.alpha_gate(x)) / self.gate_normalizer


@register_form("retnet")
class RetNet(TransitionForm):
    """Retention (Sun et al. 2023, "Retentive Network"): o = (Q Kᵀ/√d_k ⊙ D) V with D_ij = γ_h^(i−j) (j ≤ i), a
    fixed decay per head γ_h = 1 − 2^(−5−h) (:func:`retnet_decays`), no softmax; each head's output through a
    GroupNorm (``output_norm=groupnorm``). Rotary positions (RetNet's xPos without its length extrapolation) as
    the model configures them (``model.pos_encoding=rope``). State: M_t = γ M_{t−1} + k_t v_tᵀ."""

    tags = frozenset({"recurrent", "decay"})
    default_output_norm = "groupnorm"

    def build(self) -> None:
        # float64, not a buffer: casting the model (.float(), .bfloat16()) must not round the decays twice
        self.log_gamma = retnet_decays(self.num_heads).log()

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        B, L = x.shape[:2]
        return self.log_gamma.to(x.device, x.dtype)[None, :, None].expand(B, self.num_heads, L), None


@register_form("gla")
class GLA(_ScalarDecay):
    """Gated linear attention with a scalar gate per head (Yang et al. 2024; the scalar-gated form of Mamba-2's
    state space duality, Dao & Gu 2024, and fla's "simple GLA"): M_t = α_t M_{t−1} + k_t v_tᵀ with
    log α_t = log σ(x_t w_h + b_h) / τ, computed in log space (τ = ``gate_normalizer``, 16 as in GLA), q·k/√d_k.

    Args:
        gate_normalizer: τ ≥ 1; larger keeps α nearer 1 (longer memory).
    """

    tags = frozenset({"recurrent", "decay"})

    def build(self, gate_normalizer: float = 16.0) -> None:
        self.build_decay(gate_normalizer)

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return self.log_alpha(x), None


@register_form("deltanet")
class DeltaNet(TransitionForm):
    """The delta rule (Schlag et al. 2021, "Linear Transformers Are Secretly Fast Weight Programmers"; Yang et al.
    2024, "Parallelizing Linear Transformers with the Delta Rule"): M_t = (I − β_t k_t k_tᵀ) M_{t−1} + β_t k_t v_tᵀ,
    which overwrites the value stored under k_t instead of adding to it, with q and k L2-normalised per head and
    β_t = σ(x_t w_h + b_h) per head. Chunked with the WY/UT representation (a unit-triangular solve per chunk)."""

    tags = frozenset({"recurrent", "delta"})

    def build(self) -> None:
        self.beta_gate = _Gate(self.d_model, self.num_heads)

    def maps(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1)

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return None, torch.sigmoid(self.beta_gate(x))


@register_form("gated_deltanet")
class GatedDeltaNet(_ScalarDecay):
    """The gated delta rule (Yang et al. 2025, "Gated Delta Networks"): M_t = α_t (I − β_t k_t k_tᵀ) M_{t−1} +
    β_t k_t v_tᵀ, DeltaNet's update with GLA's scalar decay log α_t = log σ(x_t w_h + b_h) / τ.

    Args:
        gate_normalizer: τ ≥ 1, as :class:`GLA`'s.
    """

    tags = frozenset({"recurrent", "decay", "delta"})

    def build(self, gate_normalizer: float = 16.0) -> None:
        self.beta_gate = _Gate(self.d_model, self.num_heads)
        self.build_decay(gate_normalizer)

    maps = DeltaNet.maps

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return self.log_alpha(x), torch.sigmoid(self.beta_gate(x))
