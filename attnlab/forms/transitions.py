"""The decay and delta-rule forms: RetNet, gated linear attention, DeltaNet, Gated DeltaNet and Kimi Delta
Attention, each a setting of one transition record (:class:`~attnlab.transition.Transition`: decay in log space, per
head or per key channel; writing strength β) computed by :mod:`attnlab.transition`:

    M_t = diag(α_t) M_{t−1} + k_t v_tᵀ                        (decay: RetNet, GLA; α ≡ 1 is linear attention)
    M_t = (I − β_t k_t k_tᵀ) diag(α_t) M_{t−1} + β_t k_t v_tᵀ  (delta rule: DeltaNet α ≡ 1, Gated DeltaNet, KDA)
    o_t = M_tᵀ q_t

=================  ==========================================  =========================  ===============  =========
variant            paper                                       decay α_t (``gate``)       β_t              q, k
=================  ==========================================  =========================  ===============  =========
``retnet``         Sun et al. 2023, retention                  γ_h = 1 − 2^(−5−h)         —                k/√d_k
``gla``            Yang et al. 2024 (GLA); Dao & Gu 2024        per head (``head``), per   —                k/√d_k
                   (Mamba-2's gate)                             channel (``channel``),
                                                                Mamba-2's (``mamba2``)
``deltanet``       Schlag et al. 2021; Yang et al. 2024         —                          r·σ(x w_h + b)   L2-normed
``gated_deltanet`` Yang et al. 2025                             per head (``head``)        r·σ(x w_h + b)   L2-normed
``kda``            Kimi Team 2025, Kimi Linear                  per channel (``kda``)      r·σ(x w_h + b)   L2-normed
=================  ==========================================  =========================  ===============  =========

with the gates of :class:`_Decay`, r = ``beta_range`` (1, or 2 for negative eigenvalues, Grazzi et al. 2025) and
τ = ``gate_normalizer`` (16, GLA's). "L2-normed" is q/(‖q‖√d_k) and k/‖k‖ (:meth:`DeltaNet.maps`): the papers
write o_t = M_tᵀ q_t with the unit q, flash-linear-attention's kernels (which the papers' own code calls) scale
it by 1/√d_k (their ``scale`` default), and attnlab follows the code; the output norm hides the factor (up to its
ε), ``output_norm=None`` and the effective matrix the diagnostics read show it (tests/test_conventions.py). Each
normalises each head's output over d_v before the output projection
(``output_norm``: ``groupnorm``, RetNet's GroupNorm with one group per head, the default of ``retnet``; ``rmsnorm``,
fla's default for the others; or None). They are causal self-attention only: a layer refuses another mask in
one line. A padded token is written with k = 0 and α = 1, which leaves the state as it was. The weights the
diagnostics read are the effective matrix, the (L, L) lower-triangular map from v to the output (signed for the
delta rule).

A new member of the family is one subclass: its :meth:`TransitionForm.gates` (x → log α, β), and
:meth:`TransitionForm.maps` when q and k are mapped otherwise than k/√d_k.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnlab.transition as transition
from attnlab.checks import check_choice, check_int, check_number
from attnlab.config import AttentionConfig
from attnlab.forms.base import Form, FormInputs, FormOutput, LayerSizes, expand_heads, knobs, register_form
from attnlab.masks import PreparedMask
from attnlab.normalizers import build_normalizer
from attnlab.transition import Transition

__all__ = [
    "GLA",
    "KDA",
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
    implements = knobs(normalizer=("none",))
    refusals = knobs(
        {
            "selective": "selective attention is a softmax mechanism (it subtracts from the softmax logits; a decay or "
            "delta-rule state has none)",
            "position_bias": "a position bias is added to softmax logits; the state's decay is this form's position",
            "softcap": "soft-capping bounds softmax logits; this form has none",
            "differential": "differential attention subtracts two softmax maps; this form has none",
            "normalizer": "its weights are its decayed or delta-rule state (the variant's config sets normalizer=none)",
        }
    )
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
        k, v = self.per_step(k), self.per_step(v)
        q, k, step = self.inputs(q, expand_heads(k, self.num_heads), x)
        if mask.keys is not None:  # a padded token is no token: it writes nothing (k = 0) and forgets nothing (α = 1)
            real = mask.keys.transpose(-1, -2).to(k.dtype)  # (B, 1, L, 1)
            k = k * real.repeat_interleave(step.householder_steps, dim=2)  # each of a token's n steps
            log_decay = step.log_decay
            if log_decay is not None:
                log_decay = log_decay * (real if log_decay.dim() == 4 else real[..., 0])
            low_rank = step.low_rank
            if low_rank is not None:  # and changes nothing (a = b = 0)
                low_rank = (low_rank[0] * real, low_rank[1] * real)
            step = replace(step, log_decay=log_decay, low_rank=low_rank)
        return FormInputs(q, k, expand_heads(v, self.num_heads), mask, step)

    def per_step(self, t: Tensor) -> Tensor:
        """The layer's k (B, Gk, L, d_k) or v (B, Gv, L, d_v) → one key or value per step of the transition
        (B, G, L·n, ·): as they are (n = 1) but for DeltaProduct's n per token."""
        return t

    # ---------------------------------------------------------------------------------------------- forms

    def parallel(self, inputs: FormInputs, dropout: float = 0.0) -> FormOutput:
        """The effective matrix (:func:`~attnlab.transition.effective_matrix`) as logits and (masked) weights."""
        v, pm = inputs.v, inputs.mask
        # half precision in float32 (as the O(L) backends): a sequence's cumulative log-decays lose the differences
        exact = inputs.float() if v.dtype in (torch.float16, torch.bfloat16) else inputs
        logits = transition.effective_matrix(exact.q, exact.k, exact.transition)  # (B, H, L, L·n)
        n = inputs.transition.householder_steps
        steps = logits if n > 1 else None  # DeltaProduct: the map from the L·n values; its weights sum each token's
        if steps is not None:
            logits = steps.unflatten(-1, (-1, n)).sum(-1)  # (B, H, L, L)
        low_precision = logits.dtype in (torch.float16, torch.bfloat16)
        weights = self.normalizer(logits.float() if low_precision else logits, pm.allowed).to(v.dtype)
        mapping = weights if steps is None else steps.to(v.dtype)
        dropped = F.dropout(mapping, dropout) if dropout > 0 else mapping
        return FormOutput(torch.matmul(dropped, v), weights, logits)

    def chunked(self, inputs: FormInputs, chunk_size: int) -> Tensor:
        return transition.chunked(inputs.q, inputs.k, inputs.v, inputs.transition, chunk_size)

    def recurrent(self, inputs: FormInputs) -> Tensor:
        return transition.recurrent(inputs.q, inputs.k, inputs.v, inputs.transition)

    def output(self, out: FormOutput, inputs: FormInputs | None = None) -> Tensor:
        """z (B, H, L, d_v) → each head normalised over d_v (``output_norm``)."""
        return out.z if self.output_norm is None else self.output_norm(out.z)

    # ---------------------------------------------------------------------------------------------- decoding

    def step(self, state: Any, q: Tensor, k: Tensor, v: Tensor, x: Tensor, position: int) -> tuple[Tensor, Any]:
        """The state M (B, H, d_k, d_v), one token (:func:`~attnlab.transition.step`)."""
        k, v = self.per_step(k), self.per_step(v)
        q, k, record = self.inputs(q, expand_heads(k, self.num_heads), x)
        v = expand_heads(v, self.num_heads)
        if record.householder_steps == 1:
            k, v = k[:, :, 0], v[:, :, 0]  # (B, H, d_k), (B, H, d_v); with n steps (B, H, n, ·) as they are
        z, state = transition.step(state, q[:, :, 0], k, v, record.at(0))
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


GATES = ("head", "channel", "mamba2", "kda")


class _LowRank(nn.Module):
    """x (B, L, d_model) → (B, H, L, d_k): a rank-r map x W₁ W₂ (+ b), one value per head and key channel (GLA's
    and KDA's per-channel gate pre-activations; b = 0 at first)."""

    def __init__(self, d_model: int, num_heads: int, d_k: int, rank: int, bias: bool) -> None:
        super().__init__()
        self.num_heads, self.d_k = num_heads, d_k
        self.down = nn.Linear(d_model, rank, bias=False)
        self.up = nn.Linear(rank, num_heads * d_k, bias=bias)
        if bias:
            nn.init.zeros_(self.up.bias)

    def forward(self, x: Tensor) -> Tensor:
        B, L = x.shape[:2]
        return self.up(self.down(x)).view(B, L, self.num_heads, self.d_k).transpose(1, 2)


def _mamba_dt_bias(size: int, dt_min: float = 1e-3, dt_max: float = 0.1) -> Tensor:
    """Mamba's initial Δ bias: softplus⁻¹(Δ₀), Δ₀ log-uniform in [dt_min, dt_max] (Gu & Dao 2023; Dao & Gu 2024)."""
    dt = torch.exp(torch.rand(size) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return dt + torch.log(-torch.expm1(-dt))


class _Decay(TransitionForm):
    """The data-dependent decay shared by ``gla``, ``gated_deltanet`` and ``kda``, in log space, chosen by ``gate``:

    ===========  =================================================  ===============================================
    gate         log α_t                                            paper
    ===========  =================================================  ===============================================
    ``head``     log σ(x_t w_h + b_h) / τ, one per head              GLA's scalar gate (Yang et al. 2024)
    ``channel``  log σ(x_t W₁ W₂ + b) / τ, one per key channel       GLA (Yang et al. 2024), W₁ W₂ of rank 16
    ``mamba2``   −exp(A_log_h) · softplus(x_t w_h + dt_bias_h)        Mamba-2 (Dao & Gu 2024): SSD's scalar A_t
    ``kda``      −exp(A_log_h) · softplus(x_t W₁ W₂ + dt_bias_c)      Kimi Delta Attention (Kimi Team 2025), rank d_v
    ===========  =================================================  ===============================================

    τ = ``gate_normalizer`` (16, GLA's). ``mamba2``: A_log = log U(1, 16), dt_bias = softplus⁻¹ of a log-uniform Δ₀ in
    [0.001, 0.1] (Mamba-2's initialisation); without a delta rule, the write is also scaled by Δ_t (Mamba's
    discretisation B̄_t = Δ_t B_t: k ← Δ_t k), so that ``gla`` with ``gate=mamba2`` is Mamba-2's SSD with q, k as its
    C, B and v as its x (and gla's q·k/√d_k); a delta-rule form writes with its β instead
    (as fla's Gated DeltaNet and KDA do). ``kda``: A_log = log U(1, 16) and dt_bias the same Mamba initialisation,
    one per key channel (fla's KDA model initialises its layer so; the layer alone would start at dt_bias = 0, where
    α ≈ e^{−0.7 A} forgets within a token or two and MQAR is not learnt).
    """

    default_gate = "head"

    def build_decay(self, gate: str | None, gate_normalizer: float, gate_rank: int | None) -> None:
        self.gate = check_choice("gate", self.default_gate if gate is None else gate, GATES)
        self.gate_normalizer = check_number("gate_normalizer", gate_normalizer, low=1.0)
        H, d_k = self.num_heads, self.d_k
        if gate_rank is None:
            gate_rank = self.d_v if self.gate == "kda" else 16
        self.gate_rank = check_int("gate_rank", gate_rank, minimum=1)
        if self.gate == "head":
            self.alpha_gate: nn.Module = _Gate(self.d_model, H)
        elif self.gate == "channel":
            self.alpha_gate = _LowRank(self.d_model, H, d_k, self.gate_rank, bias=True)
        else:
            if self.gate == "mamba2":
                self.alpha_gate = nn.Linear(self.d_model, H, bias=False)
                self.dt_bias = nn.Parameter(_mamba_dt_bias(H))
            else:
                self.alpha_gate = _LowRank(self.d_model, H, d_k, self.gate_rank, bias=False)
                self.dt_bias = nn.Parameter(_mamba_dt_bias(H * d_k).view(H, d_k))
            self.A_log = nn.Parameter(torch.empty(H).uniform_(1, 16).log())

    def delta_t(self, x: Tensor) -> Tensor:
        """Mamba's step Δ_t = softplus(x_t w + dt_bias) ≥ 0 (``mamba2``: (B, H, L); ``kda``: (B, H, L, d_k))."""
        if self.gate == "mamba2":
            return F.softplus(self.alpha_gate(x).transpose(1, 2) + self.dt_bias[:, None])
        return F.softplus(self.alpha_gate(x) + self.dt_bias[:, None, :])

    def log_alpha(self, x: Tensor, dt: Tensor | None = None) -> Tensor:
        """x (B, L, d_model) → log α ≤ 0: (B, H, L) per head, (B, H, L, d_k) per key channel (the table above);
        ``dt``: the step :meth:`delta_t` of ``mamba2`` and ``kda`` when the caller has it already."""
        if self.gate in ("head", "channel"):
            return F.logsigmoid(self.alpha_gate(x)) / self.gate_normalizer
        A = self.A_log.exp()
        dt = self.delta_t(x) if dt is None else dt
        return -(A[:, None] if self.gate == "mamba2" else A[:, None, None]) * dt


@register_form("retnet")
class RetNet(TransitionForm):
    """Retention (Sun et al. 2023, "Retentive Network"): o = (Q Kᵀ/√d_k ⊙ D) V with D_ij = γ_h^(i−j) (j ≤ i), a
    fixed decay per head γ_h = 1 − 2^(−5−h) (:func:`retnet_decays`), no softmax; each head's output through a
    GroupNorm (``output_norm=groupnorm``). Rotary positions (RetNet's xPos without its length extrapolation) as
    the model configures them (``model.pos_encoding=rope``). State: M_t = γ M_{t−1} + k_t v_tᵀ."""

    tags = frozenset({"recurrent", "decay"})
    implements = TransitionForm.implements
    default_output_norm = "groupnorm"

    def build(self) -> None:
        # float64, not a buffer: casting the model (.float(), .bfloat16()) must not round the decays twice
        self.log_gamma = retnet_decays(self.num_heads).log()

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        B, L = x.shape[:2]
        return self.log_gamma.to(x.device, x.dtype)[None, :, None].expand(B, self.num_heads, L), None


BETA_RANGES = (1, 2)


def _beta(gate: _Gate, x: Tensor, beta_range: int) -> Tensor:
    """β = ``beta_range`` · σ(x w_h + b_h) (B, H, L): in (0, 1), or in (0, 2) where I − β k kᵀ (‖k‖ = 1) has the
    eigenvalue 1 − β ∈ (−1, 1) (Grazzi et al. 2025, "Unlocking State-Tracking in Linear RNNs Through Negative
    Eigenvalues")."""
    beta = torch.sigmoid(gate(x))
    return beta if beta_range == 1 else beta_range * beta


@register_form("gla")
class GLA(_Decay):
    """Gated linear attention (Yang et al. 2024, "Gated Linear Attention Transformers with Hardware-Efficient
    Training", eq. for the recurrent form): M_t = diag(α_t) M_{t−1} + k_t v_tᵀ, q·k/√d_k, with the decay ``gate``:

    * ``head`` (default): one α per head, log α_t = log σ(x_t w_h + b_h) / τ ("simple GLA"; the same form as
      Mamba-2's SSD, whose gate is ``mamba2``);
    * ``channel``: GLA's own gate, one α per key channel, log α_t = log σ(x_t W₁ W₂ + b) / τ with W₁ W₂ of rank
      ``gate_rank`` (16);
    * ``mamba2``: Mamba-2's (Dao & Gu 2024): log α_t = −exp(A_log_h) · Δ_t, Δ_t = softplus(x_t w_h + dt_bias_h),
      the write scaled by Δ_t (k ← Δ_t k).

    Args:
        gate: ``head``, ``channel``, ``mamba2`` (or ``kda``: KDA's per-channel form of Mamba's gate).
        gate_normalizer: τ ≥ 1 of the ``head`` and ``channel`` gates; larger keeps α nearer 1 (longer memory).
        gate_rank: the rank of the per-channel gate's map (default 16; ``kda``: d_v).
    """

    tags = frozenset({"recurrent", "decay"})
    implements = TransitionForm.implements
    settings: ClassVar[dict[str, dict[str, Any]]] = {"channel": {"gate": "channel"}, "mamba2": {"gate": "mamba2"}}

    def build(self, gate: str = "head", gate_normalizer: float = 16.0, gate_rank: int | None = None) -> None:
        self.build_decay(gate, gate_normalizer, gate_rank)

    def inputs(self, q: Tensor, k: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Transition]:
        q, k = self.maps(q, k)
        if self.gate != "mamba2":
            return q, k, Transition(self.log_alpha(x), None)
        dt = self.delta_t(x)  # (B, H, L)
        return q, k * dt.unsqueeze(-1), Transition(self.log_alpha(x, dt), None)


@register_form("deltanet")
class DeltaNet(TransitionForm):
    """The delta rule (Schlag et al. 2021, "Linear Transformers Are Secretly Fast Weight Programmers"; Yang et al.
    2024, "Parallelizing Linear Transformers with the Delta Rule"): M_t = (I − β_t k_t k_tᵀ) M_{t−1} + β_t k_t v_tᵀ,
    which overwrites the value stored under k_t instead of adding to it, with q and k L2-normalised per head (q then
    scaled by 1/√d_k, as flash-linear-attention's kernels: :meth:`maps`) and β_t = σ(x_t w_h + b_h) per head.
    Chunked with the WY/UT representation (a unit-triangular solve per chunk).

    Args:
        beta_range: 1 (β ∈ (0, 1)) or 2 (β = 2σ(·) ∈ (0, 2): negative eigenvalues, Grazzi et al. 2025).
    """

    tags = frozenset({"recurrent", "delta"})
    implements = TransitionForm.implements
    settings: ClassVar[dict[str, dict[str, Any]]] = {"beta2": {"beta_range": 2}}

    def build(self, beta_range: int = 1) -> None:
        self.beta_range = check_choice("beta_range", beta_range, BETA_RANGES)
        self.beta_gate = _Gate(self.d_model, self.num_heads)

    def maps(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q / (‖q‖ √d_k) and k / ‖k‖ per head: the L2 norm of the papers, then flash-linear-attention's read scale
        1/√d_k on q (its kernels' ``scale`` default, applied after ``use_qk_l2norm_in_kernel``), which the output
        norm hides up to its ε and ``output_norm=None`` shows (tests/test_conventions.py)."""
        return F.normalize(q, dim=-1) * self.d_k**-0.5, F.normalize(k, dim=-1)

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return None, _beta(self.beta_gate, x, self.beta_range)


@register_form("gated_deltanet")
class GatedDeltaNet(_Decay):
    """The gated delta rule (Yang et al. 2025, "Gated Delta Networks", eq. 10): M_t = α_t (I − β_t k_t k_tᵀ) M_{t−1}
    + β_t k_t v_tᵀ, DeltaNet's update with GLA's scalar decay log α_t = log σ(x_t w_h + b_h) / τ (``gate=head``;
    ``mamba2`` is the gate of the paper's own code, and of Qwen3-Next's).

    Args:
        gate: ``head`` (default), ``mamba2``, or a per-channel ``channel`` / ``kda`` (then the form is KDA's).
        gate_normalizer, gate_rank: as :class:`GLA`'s.
        beta_range: 1 or 2 (:class:`DeltaNet`).
    """

    tags = frozenset({"recurrent", "decay", "delta"})
    implements = TransitionForm.implements
    settings: ClassVar[dict[str, dict[str, Any]]] = {"beta2": {"beta_range": 2}}

    def build(
        self, gate: str | None = None, gate_normalizer: float = 16.0, gate_rank: int | None = None, beta_range: int = 1
    ) -> None:
        self.beta_range = check_choice("beta_range", beta_range, BETA_RANGES)
        self.beta_gate = _Gate(self.d_model, self.num_heads)
        self.build_decay(gate, gate_normalizer, gate_rank)

    maps = DeltaNet.maps

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return self.log_alpha(x), _beta(self.beta_gate, x, self.beta_range)


@register_form("kda")
class KDA(GatedDeltaNet):
    """Kimi Delta Attention (Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture", eq. for
    the KDA recurrence): M_t = (I − β_t k_t k_tᵀ) diag(α_t) M_{t−1} + β_t k_t v_tᵀ, Gated DeltaNet with one decay
    per key channel, log α_t = −exp(A_log_h) · softplus(x_t W₁ W₂ + dt_bias) (``gate=kda``, W₁ W₂ of rank d_v), q
    and k L2-normalised (q then /√d_k, as fla's ``chunk_kda``: :meth:`DeltaNet.maps`), β_t = σ(x_t w_h + b_h). Kimi
    Linear also puts a short convolution on q, k and v (the preset's ``model.short_conv=4``) and a sigmoid output
    gate after the per-head RMSNorm: the layer's ``attention.output_gate=elementwise`` (full rank; Kimi Linear's is
    low rank), off in the preset.

    Args:
        gate: ``kda`` (default) or any of :class:`GatedDeltaNet`'s.
        gate_normalizer, gate_rank, beta_range: as :class:`GatedDeltaNet`'s.
    """

    implements = TransitionForm.implements

    default_gate = "kda"
