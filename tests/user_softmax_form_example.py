"""A user's softmax-family form in one file, as README's "Add your own" shows it: a learnable temperature per head.

    w_i = softmax_j( e^{τ_h} · q_i·k_j / √d_k + bias_ij )          τ_h = 0 at first (plain scaled_dot)

computed by scaling each head's query by e^{τ_h} before every backend (:meth:`prepare`), so the softmax form's own
backends (``sdpa``, ``tiled`` …) compute it exactly: it says so with ``computed_as = "softmax"``, and it computes
every knob the softmax form does (``implements``). Importing this module registers it as ``test_temperature``;
``variant=custom variant.name=test_temperature 'imports=[user_softmax_form_example]'`` trains it. The tests that
import it remove it from the registry again.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.forms import FormInputs, register_form
from attnlab.forms.softmax import SoftmaxForm

NAME = "test_temperature"


@register_form(NAME)
class Temperature(SoftmaxForm):
    """Softmax attention with a learnable temperature e^{τ_h} per head on the content score."""

    tags = frozenset({"softmax"})
    inner_score = "scaled_dot"  # its logits: q·k/√d_k, scaled per head
    implements = SoftmaxForm.implements  # position bias, cap, normalizer, …: all computed, as the softmax form's
    computed_as = "softmax"  # its q is scaled before any backend runs: the softmax backends compute it exactly

    def __init__(self, sizes, config, **built) -> None:
        super().__init__(sizes, config, **built)
        self.log_temperature = nn.Parameter(torch.zeros(self.query_heads))  # τ (Hq,)

    def prepare(self, q, k, v, x, mask) -> FormInputs:
        q = q * self.log_temperature.exp().to(q.dtype).view(1, -1, 1, 1)  # (B, Hq, Lq, d_k)
        return super().prepare(q, k, v, x, mask)

    def step(self, state, q, k, v, x, position):
        """Decoding: the same scaled query against the cached keys."""
        q = q * self.log_temperature.exp().to(q.dtype).view(1, -1, 1, 1)
        return super().step(state, q, k, v, x, position)
