"""RWKV-7 "Goose" (Peng et al. 2025): the generalized delta rule with a diagonal-plus-low-rank transition, a form
in one file.

The transition record is :class:`~attnlab.transition.Transition` with a per-channel decay and ``low_rank = (a, b)``
(a = −κ̂, b = κ̂ ⊙ a_t), computed exactly by :mod:`attnlab.transition` (chunked with chunk-local exponents only).

What is RWKV-7's and where it lives here:

* **in this form** (the paper's time mixing, §4, eqs. 13–20, with its names): the decay w_t from its low-rank map,
  the removal key κ̂_t, the in-context learning rate a_t, the replacement key k̃_t, the bonus u_t, and the
  per-head GroupNorm (``ln_x``) between the state's read-out and the bonus.
* **in the layer**: the receptance r_t, key and value are the layer's q, k and v projections.
* **left out, with the reason**: the token shift (x_t lerped with x_{t−1} per channel before each projection) is
  outside this form, which sees the layer's projections: ``model.short_conv=2`` (the short convolution's one-tap
  case: each projected channel mixes the token with the previous one, a learned pair of weights per channel) is
  the offered stand-in, and the preset sets it; the gates here read x_t. The value residual (v mixed with the
  first layer's v) crosses layers, which one layer's form cannot see. The output gate g_t = σ(x_t W_g1) W_g2 is
  approached by the layer's gated output, ``attention.output_gate=elementwise`` (σ(x_t W_g), full rank), which the
  preset leaves off. The channel mixing (RWKV's
  MLP) is the block's MLP. Every layer starts as RWKV-7's code starts its first (the ramps w₀ and a₀ at depth 0, and
  ``ln_x``'s weight 1 where the code sets ((l + 1)/L)^0.7): a form does not know the model's depth.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnlab.transition as transition
from attnlab.checks import check_int
from attnlab.forms.base import FormInputs, FormOutput, expand_heads, register_form
from attnlab.forms.transitions import TransitionForm
from attnlab.transition import Transition

__all__ = ["RWKV7"]

DECAY_SCALE = math.exp(-0.5)
"""log w_t = −e^{−0.5} σ(d_t): w_t ∈ (e^{−e^{−0.5}}, 1) ≈ (0.545, 1) (the paper's eq. 16)."""


def lora_rank(d_model: int, d_k: int, factor: float) -> int:
    """The low-rank maps' default rank: max(32, round(factor·√d_model·d_k/64 / 32)·32) (the RWKV-7 code's, as
    flash-linear-attention's ``RWKV7Attention`` takes it: factor 2.5 for the decay and a_t)."""
    return max(32, int(round(factor * math.sqrt(d_model) * d_k / 64 / 32) * 32))


class _LoRA(nn.Module):
    """x (B, L, d_model) → (B, L, out): b + act(x W₁) W₂, W₁ zeros and W₂ orthogonal × 0.1 at first (RWKV-7's
    initialisation: the map starts at its bias b)."""

    def __init__(self, d_model: int, out: int, rank: int, activation: nn.Module | None) -> None:
        super().__init__()
        self.down = nn.Linear(d_model, rank, bias=False)
        self.activation = activation if activation is not None else nn.Identity()
        self.up = nn.Linear(rank, out, bias=True)
        nn.init.zeros_(self.down.weight)
        nn.init.orthogonal_(self.up.weight, gain=0.1)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.activation(self.down(x)))


@register_form("rwkv7")
class RWKV7(TransitionForm):
    """RWKV-7's time mixing (Peng et al. 2025, "RWKV-7 'Goose' with Expressive Dynamic State Evolution", §4):
    per head, with r_t, k_t, v_t the layer's q, k, v and the state wkv (d_v × d_k; here M = wkvᵀ),

        w_t = exp(−e^{−0.5} σ(d_t)),  d_t = w₀ + tanh(x_t W_w1) W_w2       (the decay, per key channel)
        a_t = σ(a₀ + x_t W_a1 W_a2)                                       (the in-context learning rate)
        κ̂_t = κ_t / ‖κ_t‖,  κ_t = k_t ⊙ ξ                                  (the removal key)
        k̃_t = k_t ⊙ (1 + (a_t − 1) ⊙ α)                                    (the replacement key)
        wkv_t = wkv_{t−1} (diag(w_t) − κ̂_tᵀ (a_t ⊙ κ̂_t)) + v_tᵀ k̃_t        (eq. 17)
        p_t = GroupNorm(r_t wkv_tᵀ) + u_t,  u_t = (r_t · (ρ ⊙ k̃_t)) v_t    (the bonus)

    with ξ (``k_k``), α (``k_a``) and ρ (``r_k``) learned per head and channel, initialised as the paper's code does
    (0.71 − 0.1·linear, 1.02, −0.04; w₀ and a₀ its first layer's ramps). The transition diag(w_t) − κ̂_tᵀ(a_t ⊙ κ̂_t)
    is :class:`~attnlab.transition.Transition`'s diagonal plus low rank with a = −κ̂, b = κ̂ ⊙ a_t. The weights
    the diagnostics read are the effective matrix of wkv (the map from v to r_t wkv_tᵀ, before the GroupNorm and
    the bonus). What of RWKV-7 is outside this form: the module docstring.

    Args:
        decay_rank: the rank of the decay's map W_w1 W_w2 (default :func:`lora_rank` with factor 2.5).
        a_rank: the rank of a_t's map W_a1 W_a2 (default the same).
        output_norm: ``groupnorm`` (default: the paper's GroupNorm, one group per head, an affine weight per
            channel), ``rmsnorm`` or None.
    """

    tags = frozenset({"recurrent", "decay", "delta"})
    implements = TransitionForm.implements
    default_output_norm = "groupnorm"

    def build(self, decay_rank: int | None = None, a_rank: int | None = None) -> None:
        H, d_k, d_v = self.num_heads, self.d_k, self.d_v
        default = lora_rank(self.d_model, d_k, 2.5)
        self.decay_rank = check_int("decay_rank", default if decay_rank is None else decay_rank, minimum=1)
        self.a_rank = check_int("a_rank", default if a_rank is None else a_rank, minimum=1)
        channels = H * d_k
        n = torch.arange(channels, dtype=torch.float64)
        linear = n / max(channels - 1, 1) - 0.5
        half = (d_k - 1) / 2
        zigzag = ((n % d_k) - half) / half if half > 0 else torch.zeros_like(n)
        zigzag = zigzag * zigzag.abs()
        self.w_lora = _LoRA(self.d_model, channels, self.decay_rank, nn.Tanh())
        self.a_lora = _LoRA(self.d_model, channels, self.a_rank, None)
        with torch.no_grad():
            self.w_lora.up.bias.copy_(-6 + 6 * (linear + 0.5) + 0.5 + zigzag * 2.5)  # w₀
            self.a_lora.up.bias.copy_(-0.19 + zigzag * 0.3 + linear * 0.4)  # a₀
        self.k_k = nn.Parameter((0.71 - linear * 0.1).float().view(H, d_k))  # ξ
        self.k_a = nn.Parameter(torch.full((H, d_k), 1.02))  # α
        self.r_k = nn.Parameter(torch.full((H, d_k), -0.04))  # ρ
        self.ln_x: nn.GroupNorm | None = None
        if self.output_norm_name == "groupnorm":  # RWKV's ln_x: an affine weight per channel, eps d_v·1e-5
            self.ln_x = nn.GroupNorm(H, H * d_v, eps=d_v * 1e-5)
            self.output_norm = None

    def maps(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """r and k as the layer projects them (no scaling: RWKV-7's kernel runs with scale 1)."""
        return q, k

    def inputs(self, q: Tensor, k: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Transition]:
        """r, k (B, H, L, d_k), x (B, L, d_model) → r, the replacement key k̃ and the record (log w_t per channel,
        low_rank (−κ̂, κ̂ ⊙ a_t))."""
        B, L = x.shape[:2]
        H, d_k = self.num_heads, self.d_k

        def heads(t: Tensor) -> Tensor:  # (B, L, H·d_k) → (B, H, L, d_k)
            return t.view(B, L, H, d_k).transpose(1, 2)

        log_w = -DECAY_SCALE * torch.sigmoid(heads(self.w_lora(x)))
        a = torch.sigmoid(heads(self.a_lora(x)))
        kappa = F.normalize(k * self.k_k[:, None, :], dim=-1)
        k_tilde = k * (1 + (a - 1) * self.k_a[:, None, :])
        return q, k_tilde, Transition(log_w, None, (-kappa, kappa * a))

    # ---------------------------------------------------------------------------------------------- after wkv

    def finish(self, z: Tensor, r: Tensor, k_tilde: Tensor, v: Tensor) -> Tensor:
        """z = r_t wkv_tᵀ (B, H, L, d_v) → GroupNorm(z) + u_t, the bonus u_t = (r_t · (ρ ⊙ k̃_t)) v_t."""
        if self.ln_x is not None:
            B, H, L, d_v = z.shape
            z = self.ln_x(z.transpose(1, 2).reshape(B * L, H * d_v)).view(B, L, H, d_v).transpose(1, 2)
        else:  # ``rmsnorm`` or none, as the other forms
            z = super().output(FormOutput(z))
        return z + (r * k_tilde * self.r_k[:, None, :]).sum(-1, keepdim=True) * v

    def output(self, out: FormOutput, inputs: FormInputs | None = None) -> Tensor:
        """z = r_t wkv_tᵀ, as any backend computes it from the record → :meth:`finish` with the inputs' r, k̃ and v
        (decoding: :meth:`step` has finished z already)."""
        return out.z if inputs is None else self.finish(out.z, inputs.q, inputs.k, inputs.v)

    def step(self, state: Tensor | None, q: Tensor, k: Tensor, v: Tensor, x: Tensor, position: int) -> tuple:
        r, k, record = self.inputs(q, expand_heads(k, self.num_heads), x)
        v = expand_heads(v, self.num_heads)
        z, state = transition.step(state, r[:, :, 0], k[:, :, 0], v[:, :, 0], record.at(0))
        return self.finish(z.unsqueeze(2), r, k, v), state

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, decay_rank={self.decay_rank}, a_rank={self.a_rank}"
