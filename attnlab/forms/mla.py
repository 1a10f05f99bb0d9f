"""Multi-head latent attention (DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts
Language Model", §2.1.2–2.1.3, eqs. 9–19): softmax attention whose keys and values come from one low-rank latent per
token, so that decoding caches the latent and one shared rotary key instead of every head's keys and values.

For the layer input h_t (d_model) and H heads, each head's query and key have the layer's ``d_k`` dimensions, as in
every variant: d_h = d_k − rope_dim of content and rope_dim rotary (DeepSeek-V2's d_h and d_h^R; its 192 = 128 +
64), and its value d_v::

    [c_t ; k̂_t] = h_t W^DKV                         c_t (kv_rank) the latent, k̂_t (rope_dim)       (eqs. 9, 13)
    c_t ← RMSNorm(c_t)                                (DeepSeek-V2's released code, ``kv_a_layernorm``)
    k^C_{t,i} = W^UK_i c_t,   v_{t,i} = W^UV_i c_t    each head's content key (d_h) and value (d_v)   (eqs. 10, 11)
    k^R_t = RoPE(k̂_t)                                 one rotary key shared by the heads             (eq. 13)
    q_{t,i} = [q^C_{t,i} ; RoPE(q^R_{t,i})]           q from h_t W^Q, or through its own latent:     (eqs. 12, 15)
                                                      c^Q_t = RMSNorm(h_t W^DQ), [q^C ; q^R] = c^Q_t W^UQ (q_rank)
    k_{t,i} = [k^C_{t,i} ; k^R_t]                                                                     (eq. 16)
    o_{t,i} = Σ_j softmax_j(q_{t,i}·k_{j,i} / √d_k) v_{j,i},  d_k = d_h + rope_dim                     (eq. 17)

then the layer's output gate (if any) and ``out_proj`` (W^O, eq. 18). The rotary key is decoupled from the content
key because a rotation between q^C and W^UK would stop W^UK from being absorbed into the query (§2.1.3).

**Decoding** caches [c_t ; k^R_t], kv_rank + rope_dim floats per token and layer (against 2·H·d_k for multi-head
attention), and computes with the up-projections absorbed (§2.1.2): q^C·k^C_j = (W^UK_iᵀ q^C)·c_j, so each head's
query becomes q̃ = [W^UK_iᵀ q^C_i ; q^R_i] (kv_rank + rope_dim) against the cached latents, all heads sharing one key
head (multi-query attention over the latent), and the value up-projection is applied once to the attended latent,
z_i = W^UV_i (Σ_j w_ij c_j), never to a cached token. (DeepSeek folds W^UV further into W^O; attnlab keeps z per head
because the head gate and an elementwise output gate sit between them.)

Training and the diagnostics use the expanded form above through the softmax backends (``sdpa``, ``eager`` ...), so
the normalizer, soft-capping and the weights the diagnostics read are the softmax form's, and at the same ``d_k`` the
q·k products are as large as ``scaled_dot``'s (a sweep over d_k varies the same size for every variant).
Parameters (``variant.params``): ``rope_dim`` (default d_k / 3 rounded down to even, DeepSeek-V2's 64 of 192; 0: no
rotary key, position from elsewhere; at most d_k − 1), ``kv_rank`` (default 4·d_h, DeepSeek-V2's d_c = 4 d_h) and
``q_rank`` (default None: queries projected directly, as DeepSeek-V2-Lite and Kimi Linear's MLA layers; DeepSeek-V2
uses 1536 = 12 d_h) and ``rope_base`` (default 10000, the rotary base). Rotary positions are always on the decoupled
key and query parts, never on the content parts, so the layer's own rotary knob (``model.pos_encoding=rope``) is
refused with a pointer to ``rope_dim`` and ``rope_base``. The layer's short convolution, QK-norm, grouped key/value
heads and differential maps do not apply to a latent projection and are refused in one line (the layer's capability
check, :func:`~attnlab.forms.base.refuse_unimplemented`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from attnlab.checks import check_int
from attnlab.forms.base import LayerOptionError, LayerSizes, knobs, register_form
from attnlab.forms.softmax import SoftmaxForm
from attnlab.masks import PreparedMask
from attnlab.positions import RotaryEmbedding

if TYPE_CHECKING:
    from attnlab.config import AttentionConfig

__all__ = ["LatentCache", "MultiHeadLatentAttention"]

MLA_PARAMS = ("kv_rank", "q_rank", "rope_dim", "rope_base")


@dataclass
class LatentCache:
    """Multi-head latent attention's decoding state: [c_t ; k^R_t] (B, capacity, kv_rank + rope_dim) of every token
    so far, preallocated and doubled when full; ``length`` tokens held."""

    latent: Tensor
    length: int = 0

    def nbytes(self) -> int:
        """Bytes of the tokens held (not the spare capacity)."""
        return self.latent[:, : self.length].numel() * self.latent.element_size()


@register_form("mla")
class MultiHeadLatentAttention(SoftmaxForm):
    """Multi-head latent attention (module docstring): the softmax form over keys and values up-projected from a
    shared latent, with a decoupled rotary key; decoding from the latent cache with the up-projections absorbed.

    Modules (DeepSeek-V2's names in brackets): ``kv_down`` d_model → kv_rank + rope_dim [W^DKV and W^KR,
    ``kv_a_proj_with_mqa``], ``kv_norm`` [``kv_a_layernorm``], ``k_up`` kv_rank → H·d_h [W^UK], ``v_up``
    kv_rank → H·d_v [W^UV]; the query: ``q_proj`` d_model → H·d_k, or with ``q_rank``: ``q_down``
    d_model → q_rank [W^DQ], ``q_latent_norm`` [``q_a_layernorm``], ``q_up`` q_rank → H·d_k [W^UQ and
    W^QR]; ``rotary`` the decoupled rotary positions. The up-projections have no bias (the absorption needs it); the
    down-projections follow the layer's ``bias``. (A form's modules must not take the layer's own names, ``q_norm``,
    ``rope`` …: the layer's attribute delegation would set them.)"""

    tags = frozenset({"softmax", "latent"})
    inner_score = "scaled_dot"
    projects = True
    # its scores are plain softmax over the up-projected q and k: softmax's backends compute them
    layer_kind = "M"  # model.pattern=…M
    computed_as = "softmax"
    implements = knobs({k: v for k, v in SoftmaxForm.implements.items() if k != "differential"})
    refusals = knobs(
        {
            "rope": "its rotary positions are always on, on the decoupled key of variant.params.rope_dim (their base: "
            "variant.params.rope_base)",
            "qk_norm": "it projects its keys and values from one latent shared by the heads",
            "short_conv": "it projects its keys and values from one latent shared by the heads",
            "short_conv_residual": "it projects its keys and values from one latent shared by the heads",
            "num_kv_heads": "its heads share one latent (the cache is the latent, not grouped key/value heads)",
            "differential": "it projects its keys and values from one latent shared by the heads",
        }
    )

    def __init__(
        self,
        sizes: LayerSizes,
        config: AttentionConfig,
        score: nn.Module | None = None,
        position_bias: nn.Module | None = None,
        normalizer: nn.Module | None = None,
    ) -> None:
        params = dict(config.score_params)
        unknown = sorted(set(params) - set(MLA_PARAMS))
        if unknown:
            raise ValueError(f"variant mla has no parameter '{unknown[0]}'; parameters: {', '.join(MLA_PARAMS)}")
        self._refuse_layer_options(sizes, config)
        d_k = sizes.d_k
        if params.get("rope_dim") is None:
            rope_dim = d_k // 6 * 2  # d_k / 3, rounded down to an even size
        else:
            rope_dim = check_int("rope_dim", params["rope_dim"], minimum=0)
        if rope_dim % 2:
            raise ValueError(f"rope_dim must be even (rotary positions turn pairs of dimensions), got {rope_dim}")
        if rope_dim >= d_k:
            raise ValueError(
                f"rope_dim must be below d_k={d_k} (each head's query and key: d_k − rope_dim content dimensions and "
                f"rope_dim rotary), got {rope_dim}"
            )
        d_h = d_k - rope_dim
        kv_rank = 4 * d_h if params.get("kv_rank") is None else check_int("kv_rank", params["kv_rank"], minimum=1)
        q_rank = None if params.get("q_rank") is None else check_int("q_rank", params["q_rank"], minimum=1)
        # the softmax form over q and k of d_k = d_h + rope_dim dimensions: scale 1 / √d_k (eq. 17)
        super().__init__(sizes, config, score, position_bias, normalizer)
        self.d_h, self.kv_rank, self.q_rank, self.rope_dim = d_h, kv_rank, q_rank, rope_dim
        H, d_v, d_model = sizes.num_heads, sizes.d_v, sizes.d_model
        self.kv_down = nn.Linear(d_model, kv_rank + rope_dim, bias=sizes.bias)
        self.kv_norm = nn.RMSNorm(kv_rank, eps=1e-6)
        self.k_up = nn.Linear(kv_rank, H * d_h, bias=False)
        self.v_up = nn.Linear(kv_rank, H * d_v, bias=False)
        if q_rank is None:
            self.q_proj = nn.Linear(d_model, H * (d_h + rope_dim), bias=sizes.bias)
        else:
            self.q_down = nn.Linear(d_model, q_rank, bias=sizes.bias)
            self.q_latent_norm = nn.RMSNorm(q_rank, eps=1e-6)
            self.q_up = nn.Linear(q_rank, H * (d_h + rope_dim), bias=False)
        rope_base = 10000.0 if params.get("rope_base") is None else params["rope_base"]
        self.rotary = RotaryEmbedding(rope_dim, base=rope_base) if rope_dim else None

    @staticmethod
    def _refuse_layer_options(sizes: LayerSizes, config: AttentionConfig) -> None:
        """One line for a layer option that a latent projection does not take."""
        refused = {
            "short_conv": config.short_conv is not None,
            "qk_norm": config.qk_norm is not None,
            "num_kv_heads": config.num_kv_heads not in (None, sizes.num_heads),
            "differential": config.differential,
        }
        for option, given in refused.items():
            if given:
                raise LayerOptionError(
                    f"variant mla projects its keys and values from one latent shared by the heads, so it takes no "
                    f"{option} (got {getattr(config, option)}): leave {option} at its default with variant=mla"
                )

    def extra_repr(self) -> str:
        q = "q direct" if self.q_rank is None else f"q_rank={self.q_rank}"
        return f"kv_rank={self.kv_rank}, {q}, rope_dim={self.rope_dim}, d_h={self.d_h}"

    # ---------------------------------------------------------------------------------------------- projection

    def queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, L, d_model) → (q^C (B, H, L, d_h), q^R (B, H, L, rope_dim)) before the rotation."""
        B, L, _ = x.shape
        q = self.q_proj(x) if self.q_rank is None else self.q_up(self.q_latent_norm(self.q_down(x)))
        q = q.view(B, L, self.num_heads, self.d_k).transpose(1, 2)  # (B, H, L, d_k = d_h + rope_dim)
        return q.split([self.d_h, self.rope_dim], dim=-1)

    def latent(self, x: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        """x (B, L, d_model) → (c (B, L, kv_rank) normalised, k^R (B, 1, L, rope_dim) rotated at positions
        offset …)."""
        c, k_rope = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)
        k_rope = k_rope.unsqueeze(1)  # (B, 1, L, rope_dim): one rotary key for every head
        return self.kv_norm(c), (k_rope if self.rotary is None else self.rotary(k_rope, offset))

    def project(
        self, x: Tensor, key_value: Tensor, offset: int = 0, decoding: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, Lq, d_model), key_value (B, Lk, d_model) → q (B, H, Lq, d_k), k (B, H, Lk, d_k), v (B, H, Lk, d_v)
        (eqs. 9–16), d_k = d_h + rope_dim. ``decoding``: the absorbed form instead, q̃ (B, H, Lq,
        kv_rank + rope_dim), the latent key [c ; k^R] (B, 1, Lk, kv_rank + rope_dim) and c (B, 1, Lk, kv_rank)."""
        q_c, q_r = self.queries(x)
        if self.rotary is not None:
            q_r = self.rotary(q_r, offset)
        c, k_r = self.latent(key_value, offset)
        B, Lk, _ = c.shape
        H = self.num_heads
        if decoding:
            w_uk = self.k_up.weight.view(H, self.d_h, self.kv_rank)  # W^UK_i (d_h, kv_rank)
            q_latent = torch.einsum("bhld,hdr->bhlr", q_c, w_uk)  # W^UK_iᵀ q^C_i
            c = c.unsqueeze(1)  # (B, 1, Lk, kv_rank)
            return torch.cat([q_latent, q_r], dim=-1), torch.cat([c, k_r], dim=-1), c
        k_c = self.k_up(c).view(B, Lk, H, self.d_h).transpose(1, 2)  # (B, H, Lk, d_h)
        v = self.v_up(c).view(B, Lk, H, self.sizes.d_v).transpose(1, 2)  # (B, H, Lk, d_v)
        k = torch.cat([k_c, k_r.expand(B, H, Lk, self.rope_dim)], dim=-1)  # [k^C_i ; k^R]
        return torch.cat([q_c, q_r], dim=-1), k, v

    # ---------------------------------------------------------------------------------------------- decoding

    def step(self, state: Any, q: Tensor, k: Tensor, v: Tensor, x: Tensor, position: int) -> tuple[Tensor, Any]:
        """One token from the latent cache, the up-projections absorbed: q̃ (B, H, 1, kv_rank + rope_dim), the
        token's latent key [c ; k^R] (B, 1, 1, kv_rank + rope_dim) (``v``, its c, is read back from the cache) →
        z (B, H, 1, d_v), z_i = W^UV_i Σ_j w_ij c_j."""
        t = position
        B = q.shape[0]
        if state is None or t == state.latent.shape[1]:  # grow the preallocated cache (doubling)
            grown = LatentCache(k.new_zeros(B, max(16, 2 * t), k.shape[-1]), t)
            if state is not None:
                grown.latent[:, :t] = state.latent[:, :t]
            state = grown
        state.latent[:, t] = k[:, 0, 0]
        state.length = t + 1
        keys = state.latent[:, : t + 1]  # (B, t + 1, kv_rank + rope_dim): one key head for every query head
        # the heads as rows of one product per sequence (bmm), never the latents repeated per head
        logits = torch.bmm(q[:, :, 0], keys.transpose(1, 2)).mul_(self.score.scale)  # (B, H, t + 1): q̃·k / √d_k
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        row = self.visible_keys(t, q.device)  # (1, t + 1)
        weights = self.normalize(logits.unsqueeze(2), PreparedMask.from_tensor(row.view(1, 1, 1, t + 1)), keys.dtype)
        attended = torch.bmm(weights[:, :, 0], keys[..., : self.kv_rank])  # (B, H, kv_rank): Σ_j w_ij c_j
        w_uv = self.v_up.weight.view(self.num_heads, self.sizes.d_v, self.kv_rank)  # W^UV_i (d_v, kv_rank)
        return torch.einsum("bhr,hvr->bhv", attended, w_uv).unsqueeze(2), state  # (B, H, 1, d_v)

    def state_size(self, length: int) -> int:
        """The latent cache: kv_rank + rope_dim floats per cached key (a causal window: the window's keys)."""
        return self._cached_keys(length) * (self.kv_rank + self.rope_dim)

    def prefill(
        self, batch: int, length: int, generator: torch.Generator, device: torch.device, dtype: torch.dtype
    ) -> LatentCache:
        """Random latents of ``length`` tokens, with room for 64 more."""
        latent = torch.randn(batch, length + 64, self.kv_rank + self.rope_dim, generator=generator)
        return LatentCache(latent.to(device, dtype), length)
