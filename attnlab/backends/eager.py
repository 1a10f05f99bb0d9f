"""The ``eager`` backend: every stage of :class:`~attnlab.attention.MultiHeadAttention` in turn, with the
(B, H, Lq, Lk) weights materialised. The reference every other backend equals, and what the diagnostics read."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnlab.backends import Backend, register_backend


@register_backend("eager")
class Eager(Backend):
    """Any configuration, any device: :meth:`~attnlab.attention.MultiHeadAttention.attend`."""

    def attend(self, attn: Any, x: Tensor, key_value: Tensor | None, mask: Any) -> tuple[Tensor, Tensor | None]:
        o = attn.attend(x, key_value, mask)
        return o.out, o.weights
