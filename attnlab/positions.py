"""Position encodings: absolute ones added to the token embeddings, and rotary ones applied to q and k.

* :class:`SinusoidalPositionalEncoding` (Vaswani et al. 2017, §3.5) and :class:`LearnedPositionalEncoding` give
  a (L, d_model) table added to the embeddings (``model.pos_encoding=sinusoidal|learned``).
* :class:`RotaryEmbedding` (Su et al. 2021, RoFormer) rotates each pair (q_{2i}, q_{2i+1}) of a query or key at
  position m by the angle m·θ_i, θ_i = base^(−2i/d): seen as complex numbers, q_m ↦ q_m e^{imθ}. Then
  ⟨R_m q, R_n k⟩ depends on m − n only (``model.pos_encoding=rope``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnlab.checks import check_int, check_number
from attnlab.registry import BoundedCache

__all__ = ["LearnedPositionalEncoding", "RotaryEmbedding", "SinusoidalPositionalEncoding"]


class SinusoidalPositionalEncoding(nn.Module):
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d)); buffer ``pe`` (max_len, d)."""

    def __init__(self, d_model: int, max_len: int = 512) -> None:
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float64)[:, None]
        inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos * inv_freq)
        pe[:, 1::2] = torch.cos(pos * inv_freq)[:, : d_model // 2]
        self.register_buffer("pe", pe.float(), persistent=False)

    def forward(self, length: int) -> Tensor:
        """→ (length, d_model)."""
        if length > self.pe.shape[0]:
            raise ValueError(f"sequence length {length} exceeds the positional table's max_len {self.pe.shape[0]}")
        return self.pe[:length]


class LearnedPositionalEncoding(nn.Module):
    """A learned vector per absolute position (``weight`` (max_len, d_model), N(0, 0.02²) initialisation)."""

    def __init__(self, d_model: int, max_len: int = 512) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    def forward(self, length: int) -> Tensor:
        """→ (length, d_model)."""
        if length > self.weight.shape[0]:
            raise ValueError(f"sequence length {length} exceeds the positional table's max_len {self.weight.shape[0]}")
        return self.weight[:length]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021): x_m ↦ R_m x_m on (…, L, d) queries or keys.

    Pairs (x_{2i}, x_{2i+1}) are rotated by m·θ_i with θ_i = base^(−2i/d), d = ``dim``, as the complex product
    (x_{2i} + i·x_{2i+1})·e^{imθ_i} (RoFormer's interleaved pairs).

    Args:
        dim: the size d of the vectors (d_k).
        base: the wavelength base (10000 in RoFormer and most LLMs).
        fraction: rotate only the first r = ``2·⌊fraction·d/2⌋`` dimensions and leave the rest untouched (partial
            rotary). At least one pair rotates.
        spectrum: which frequencies the r rotated dimensions get, two different published choices:
            ``full`` (default): θ_i = base^(−2i/d), the first r/2 frequencies of the full-d spectrum, i.e. the
            lowest are dropped (Barbero et al. 2024's p-RoPE); ``rotated``: θ_i = base^(−2i/r), the whole spectrum
            spread over the r rotated dimensions (GPT-NeoX's ``rotary_pct``). With ``fraction=1`` they agree.
            (Pairs are RoFormer's interleaved ones in both; NeoX pairs dimension i with i + r/2, a fixed
            permutation of q and k's dimensions that learned projections absorb.)
    """

    SPECTRA = ("full", "rotated")

    def __init__(self, dim: int, base: float = 10000.0, fraction: float = 1.0, spectrum: str = "full") -> None:
        super().__init__()
        self.dim = check_int("rope dim (d_k)", dim, minimum=2)
        self.base = check_number("rope.base", base, low=1.0, low_open=True)
        self.fraction = check_number("rope.fraction", fraction, 0.0, 1.0, low_open=True)
        self.rotated = 2 * int(self.fraction * dim / 2 + 1e-9)  # 2·⌊fraction·d/2⌋, robust to 0.58·100 = 57.99…
        if self.rotated < 2:
            raise ValueError(
                f"rope.fraction={fraction} rotates no pair of the d_k={dim} dimensions; use a fraction >= {2 / dim:g}"
            )
        if spectrum not in self.SPECTRA:
            raise ValueError(f"rope.spectrum must be full (p-RoPE) or rotated (GPT-NeoX rotary_pct), got {spectrum!r}")
        self.spectrum = spectrum
        i = torch.arange(self.rotated // 2, dtype=torch.float64)
        # θ_i in float64, deliberately not a buffer: casting the model (.bfloat16()) must not round the angles
        self.inv_freq = self.base ** (-2 * i / (dim if spectrum == "full" else self.rotated))
        self._tables = BoundedCache()

    def cos_sin(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos(m θ_i), sin(m θ_i), each (length, rotated/2), computed in float64 and cached per length/device/dtype."""

        def make() -> tuple[Tensor, Tensor]:
            angle = torch.arange(length, dtype=torch.float64, device=device)[:, None] * self.inv_freq.to(device)
            return angle.cos().to(dtype), angle.sin().to(dtype)

        return self._tables.get_or_make((length, device, dtype), make)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """x (…, L, dim) at positions offset … offset + L − 1 (default 0 …) → the rotated x, same shape. A non-zero
        ``offset`` (one token decoded at a time) computes its angles afresh rather than caching a table per offset."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"rotary embedding of dim {self.dim} got vectors of size {x.shape[-1]}")
        if offset:
            positions = torch.arange(offset, offset + x.shape[-2], dtype=torch.float64, device=x.device)
            angle = positions[:, None] * self.inv_freq.to(x.device)
            cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        else:
            cos, sin = self.cos_sin(x.shape[-2], x.device, x.dtype)  # (L, r/2)
        r = self.rotated
        pairs = x[..., :r].unflatten(-1, (r // 2, 2))  # (…, L, r/2, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)  # (…, L, r)
        return rotated if r == self.dim else torch.cat((rotated, x[..., r:]), dim=-1)

    def extra_repr(self) -> str:
        spectrum = "" if self.rotated == self.dim else f", spectrum={self.spectrum}"
        return f"dim={self.dim}, base={self.base:g}, fraction={self.fraction:g} ({self.rotated} rotated){spectrum}"
