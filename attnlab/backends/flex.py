"""The ``flex`` backend: a layer through one FlexAttention call (``torch.nn.attention.flex_attention``), which
``torch.compile`` fuses into one kernel with the position bias, the soft-cap and the mask inside it: no
(B, H, Lq, Lk) tensor is materialised, for the configurations that SDPA cannot take (a learned position bias's
gradient, soft-capping, masks beyond causal).

What it expresses, exactly as the eager path computes it:

* **scores**: every dot-product score (:class:`~attnlab.scores.DotProductScore`: ``scaled_dot``, ``dot``,
  ``general``, ``cosine``): q and k go through the score's query_map / key_map outside the kernel, q is scaled by the
  score's scale there (as the eager path does) and FlexAttention runs with ``scale=1``;
* **position biases** as a ``score_mod`` (:meth:`~attnlab.position_bias.PositionBias.score_mod`): Shaw's a^K through
  the (B, H, Lq, 2k + 1) table q·w^K read at the clipped distance, T5 through a per-head table over the offsets
  k − q (H, Lq + Lk − 1), ALiBi from its slopes (H,); a user bias (or a score's own bias) that offers ``score_mod``;
* **soft-capping**: c·tanh(s / c) in the ``score_mod``, after the bias (as
  :meth:`~attnlab.forms.softmax.SoftmaxForm.logits`);
* **forgetting attention** (:mod:`attnlab.forms.forgetting`): D_ij = c_i − c_j read from the cumulative log forget
  gates c (B, H, L) in the ``score_mod``, after the soft-cap; on CUDA ``auto`` gives it to flex (on the CPU ``sdpa``
  computes it with the bias folded into q and k);
* **every mask** as a ``mask_mod`` with its ``BlockMask`` (:func:`block_mask_for`): causal in closed form, causal AND
  key padding from the (B, Lk) key flags, any other (sliding window, causal window, compositions, user masks,
  padding, a bool tensor) read by index from the prepared mask's bool tensor, which the kernel touches only in the
  blocks that are partly visible. The BlockMask is cached with the prepared mask (``PreparedMask.derived``), per
  (B, H, Lq, Lk): a position-only mask's prepared form is itself cached per (Lq, Lk, device), so its BlockMask is
  built once per shape; a per-batch mask (padding, which reads the tokens or lengths) is prepared anew each call,
  and so is its BlockMask (one per call). A row that sees no key gives 0 (FlexAttention's own rule: its output
  and its gradient are 0, as the eager path's);
* **grouped heads** through ``enable_gqa``, and **differential attention** as the ``sdpa`` backend does (both maps
  in one call, then w₁ v − λ w₂ v).

What it refuses (one line, in :meth:`Flex.config_reason` / :meth:`Flex.call_reason`): scores that are not dot
products, value-side terms (Shaw's a^V), normalizers other than the softmax (sparsemax, entmax, softpick, ...) and
sink logits (softmax1, sink), a position bias without ``score_mod``, dropout on the weights, float64, head sizes
below 16 on CUDA (Triton's tl.dot), and every call on the CPU that ``auto`` would make: there FlexAttention is
forward-only in torch 2.13 (a backward raises NotImplementedError), so ``auto`` never chooses it, and a forced
``attention.backend=flex`` runs on the CPU only under ``torch.no_grad()`` (to check a translation).

Where ``auto`` chooses it: it comes before ``sdpa`` in :data:`~attnlab.backends.ORDER`, and on CUDA it takes a
layer that SDPA would give a materialised (B, H, Lq, Lk) float mask or could not compute: a position bias (a
score's own or the stage's), soft-capping, or a mask other than none, causal and padding (a sliding window, a
composition, a user mask). A plain layer (no bias, no soft-cap, such a mask) stays with ``sdpa``, whose flash and
memory-efficient kernels compute it without a compile.

Compiling: the call goes through one module-level ``torch.compile(flex_attention, dynamic=False)``
(:func:`compiled_flex_attention`); the score_mods and mask_mods are closures of module-level functions over the
tensors they read, so that dynamo sees the same code for every call and layer (new tensors in the same closures are
new inputs, not a new graph) and compiles once per (shapes, terms, soft-cap value, mask kind, grad mode). On a
2-core CPU (measured under load) a compile takes 9–20 s, the first of a process with a cold Inductor cache up to
~45 s (~16 s of CPU time: it also builds Inductor's CPU checks), 5–10 s from a warm cache (``/tmp/torchinductor_*``);
a call that hits a compiled graph adds microseconds. Dynamo's ``recompile_limit`` (8 by default) bounds the compiled
variants of one function per process, and past it a call runs unfused (with dynamo's warning): a benchmark or a
check that builds a dozen biased models in one process passed it on an H100 (2026-11-28), so making the compiled
function raises the limit to at least :data:`RECOMPILE_LIMIT`. Under a dispatch mode (the FLOP counter,
:func:`attnlab.compute.count_flops`) FlexAttention cannot run, compiled or not, in torch 2.11–2.13: ``auto`` then
takes the next backend (the FLOPs are the same products) and a forced ``flex`` raises its one line.
``attention.backend_params.compile=false`` runs FlexAttention's unfused reference instead (it materialises the
scores; for checking a translation without a compile).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils._python_dispatch import _get_current_dispatch_mode

from attnlab.backends.base import Conditions, LayerSpec, build_backend, register_backend, spec_of
from attnlab.backends.sdpa import FusedSoftmax
from attnlab.forms import FormInputs, FormOutput
from attnlab.forms.forgetting import cumulative_log_forget
from attnlab.masks import PreparedMask
from attnlab.position_bias import PositionBias, ScoreMod
from attnlab.scores import DotProductScore

__all__ = ["Flex", "block_mask_for", "compiled_flex_attention", "flex_reason", "score_mod_for"]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""A FlexAttention ``mask_mod``: (b, h, q_idx, kv_idx) → bool, all 0-d tensors."""

_COMPILED: dict[str, Callable[..., Tensor]] = {}
RECOMPILE_LIMIT = 64
"""The least dynamo ``recompile_limit`` while the compiled FlexAttention is in use: each (shapes, terms, soft-cap,
mask kind, grad mode) compiles once, and the default 8 ran out within one benchmark group."""


def compiled_flex_attention() -> Callable[..., Tensor]:
    """``torch.compile(flex_attention, dynamic=False)``, made once per process (the fused kernel; uncompiled,
    FlexAttention runs a reference that materialises the scores)."""
    fn = _COMPILED.get("flex_attention")
    if fn is None:
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        fn = _COMPILED["flex_attention"] = torch.compile(flex_attention, dynamic=False)
    return fn


# --------------------------------------------------------------------------------------------- what it computes


def _bias_terms(form: Any) -> list[tuple[str, Any]]:
    """The additive logit terms beside q·k: (name, module) of the score's own bias and the position-bias stage."""
    terms = []
    if isinstance(form.score, DotProductScore) and form.score.position_term() is not None:
        terms.append((f"score={form.config.score}'s own bias", form.score))
    if form.position_bias is not None:
        terms.append((f"position_bias={form.config.position_bias}", form.position_bias))
    return terms


def _offers_score_mod(term: Any) -> bool:
    if isinstance(term, PositionBias):
        return term.has_score_mod
    return callable(getattr(term, "score_mod", None))


def flex_reason(form: Any) -> str | None:
    """None when FlexAttention computes every stage of the softmax form beyond its features exactly, else the first
    stage it cannot (one line)."""
    form = getattr(form, "form", form)
    if form.extra_logit() is not None:
        return f"it has no sink logit (normalizer={form.config.normalizer}); softmax only"
    if not getattr(form.normalizer, "is_softmax", False):
        return f"it computes the softmax only, not normalizer={form.config.normalizer}"
    for name, term in _bias_terms(form):
        if not _offers_score_mod(term):
            return f"{name} offers no FlexAttention score_mod (PositionBias.score_mod); shaw, t5 and alibi do"
    return None


def score_mod_for(form: Any, q: Tensor, num_keys: int) -> ScoreMod | None:
    """The layer's ``score_mod`` for q (B, Hq, Lq, d_k) (transformed, before the score's query_map) and Lk keys:
    the score's own bias, then the position bias, then the soft-cap; None when there is none of them."""
    terms = []
    for _, term in _bias_terms(form):
        mod = term.score_mod(q, num_keys)
        if mod is None:  # a bias that declines at this shape: its tensor, read by index
            bias = term.bias(q, num_keys) if isinstance(term, DotProductScore) else term(q, num_keys)
            mod = _dense_bias_mod(bias.expand(q.shape[0], q.shape[1], q.shape[2], num_keys))
        terms.append(mod)
    if form.softcap is None:
        return None if not terms else terms[0] if len(terms) == 1 else _sum_mod(tuple(terms))
    return _capped_mod(tuple(terms), float(form.softcap))


def _dense_bias_mod(bias: Tensor) -> ScoreMod:
    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + bias[b, h, q_idx, kv_idx]

    return mod


def _sum_mod(terms: tuple[ScoreMod, ...]) -> ScoreMod:
    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        for term in terms:
            score = term(score, b, h, q_idx, kv_idx)
        return score

    return mod


def _capped_mod(terms: tuple[ScoreMod, ...], cap: float) -> ScoreMod:
    """The terms, then c·tanh(s / c)."""

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        for term in terms:
            score = term(score, b, h, q_idx, kv_idx)
        return cap * torch.tanh(score / cap)

    return mod


def _forgetting_mod(inner: ScoreMod | None, c: Tensor, offset: int) -> ScoreMod:
    """``inner`` (or nothing), then forgetting attention's bias c[b, h, i + offset] − c[b, h, j] (c (B, H, Lk))."""

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if inner is not None:
            score = inner(score, b, h, q_idx, kv_idx)
        return score + (c[b, h, q_idx + offset] - c[b, h, kv_idx])

    return mod


# --------------------------------------------------------------------------------------------- masks


def _causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return kv_idx <= q_idx


def _causal_keys_mod(keys: Tensor) -> MaskMod:
    """Causal AND the key flags ``keys`` (B, Lk)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & keys[b, kv_idx]

    return mask_mod


def _read_qk(allowed: Tensor) -> MaskMod:
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return allowed[q_idx, kv_idx]

    return mask_mod


def _read_bqk(allowed: Tensor) -> MaskMod:
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return allowed[b, q_idx, kv_idx]

    return mask_mod


def _read_hqk(allowed: Tensor) -> MaskMod:
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return allowed[h, q_idx, kv_idx]

    return mask_mod


def _read_bhqk(allowed: Tensor) -> MaskMod:
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return allowed[b, h, q_idx, kv_idx]

    return mask_mod


def _mask_mod(pm: PreparedMask, batch: int, num_queries: int, num_keys: int) -> tuple[MaskMod, bool, bool]:
    """(mask_mod, per batch, per head) of a prepared mask for (B, Hq, Lq, Lk)."""
    if pm.structure == "causal" and pm.keys is None:
        return _causal, False, False
    if pm.structure == "causal" and num_queries == num_keys:  # causal AND key padding: no dense tensor
        keys = pm.keys.reshape(pm.keys.shape[0], num_keys).expand(batch, num_keys)  # (B, Lk)
        return _causal_keys_mod(keys), True, False
    allowed = pm.allowed
    per_batch, per_head = allowed.shape[0] > 1, allowed.shape[1] > 1
    allowed = allowed.expand(allowed.shape[0], allowed.shape[1], num_queries, num_keys)
    if per_batch and per_head:
        return _read_bhqk(allowed), True, True
    if per_batch:
        return _read_bqk(allowed[:, 0]), True, False
    if per_head:
        return _read_hqk(allowed[0]), False, True
    return _read_qk(allowed[0, 0]), False, False


def block_mask_for(
    pm: PreparedMask | None, batch: int, heads: int, num_queries: int, num_keys: int, device: torch.device
) -> BlockMask | None:
    """The FlexAttention ``BlockMask`` of a prepared mask for q (B, Hq, Lq, ·) and Lk keys (None: no mask), made on
    first use and cached with the prepared mask (``pm.derived``), per (B, Hq, Lq, Lk) where the mask varies along
    them: a position-only mask's BlockMask (broadcast over B and H) is built once per (Lq, Lk, device), a per-batch
    mask's (padding) once per call, as its prepared mask is."""
    if pm is None:
        return None
    mask_mod, per_batch, per_head = _mask_mod(pm, batch, num_queries, num_keys)
    B = batch if per_batch else None
    H = heads if per_head else None
    key = ("flex_block_mask", B, H, num_queries, num_keys, str(device))
    return pm.derived.get_or_make(key, lambda: create_block_mask(mask_mod, B, H, num_queries, num_keys, device=device))


# --------------------------------------------------------------------------------------------- the backend


_SDPA_MASKS = ("none", "causal", "padding", "causal+padding")
"""The mask forms that SDPA's fused kernels compute without a materialised bias (``auto`` leaves these to sdpa)."""


def _plain(form: Any) -> bool:
    """Whether ``form`` has neither an additive logit term (a score's own, a position bias) nor a soft-cap."""
    own = isinstance(form.score, DotProductScore) and form.score.position_term() is not None
    return not own and form.position_bias is None and form.softcap is None


@register_backend("flex")
class Flex(FusedSoftmax):
    """The layer through one (compiled) FlexAttention call; see the module's docstring for what it expresses."""

    params: ClassVar[dict[str, Any]] = {"compile": True}
    computes = FusedSoftmax.computes | {"softcap", "forgetting"}

    def check_params(self, params: dict[str, Any]) -> None:
        if "compile" in params and not isinstance(params["compile"], bool):
            raise ValueError(
                f"attention.backend_params.compile must be true (fused) or false (unfused reference), "
                f"got {params['compile']!r}"
            )

    def config_reason(self, layer: Any) -> str | None:
        spec = spec_of(layer)
        return super().config_reason(spec) or flex_reason(spec.form)

    def call_reason(self, layer: Any, when: Conditions) -> str | None:
        spec = spec_of(layer)
        if not torch.compiler.is_compiling() and _get_current_dispatch_mode() is not None:  # (no graph break)
            return "FlexAttention cannot run under a dispatch mode (the FLOP counter) in this torch"
        if when.device == "cpu":
            if spec.config.backend != "flex":
                return "it is for CUDA (on the CPU FlexAttention is forward-only here): force it with backend=flex"
            if when.grad:
                return (
                    "CPU FlexAttention is forward-only in this torch (a backward raises NotImplementedError): "
                    "call it under torch.no_grad(), or on CUDA"
                )
        elif when.device != "cuda":
            return f"FlexAttention runs on CUDA (and forward-only on the CPU), not {when.device}"
        elif (
            spec.config.backend != "flex"
            and _plain(spec.form)
            and "forgetting" not in spec.features
            and when.mask in _SDPA_MASKS
        ):
            # auto on CUDA: SDPA's fused kernels (flash, memory-efficient) already compute this layer without a
            # (B, H, Lq, Lk) tensor; flex is for what SDPA would materialise (a bias, a soft-cap, other masks)
            return "SDPA's fused kernels compute this layer (no bias, no soft-cap, a causal or padding mask)"
        if when.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"FlexAttention computes float32, float16 and bfloat16, not {str(when.dtype).removeprefix('torch.')}"
        if when.device == "cuda" and min(spec.d_k, spec.d_v) < 16:
            return f"FlexAttention on CUDA needs d_k and d_v ≥ 16, got d_k={spec.d_k}, d_v={spec.d_v}"
        if when.training and spec.dropout > 0:
            return "it applies no dropout to the weights"
        return None

    def compute(self, spec: LayerSpec, inputs: FormInputs, dropout: float) -> FormOutput:
        """q (B, Hq, Lq, d_k), k (B, Gk, Lk, d_k), v (B, G, Lk, d_v) through one FlexAttention call → z
        (B, Hq, Lq, d_v) (both maps of differential attention)."""
        form = spec.form
        q, k, v, pm = inputs.q, inputs.k, inputs.v, inputs.mask
        B, Hq, Lq, _ = q.shape
        Lk = k.shape[2]
        if Lq == 0 or Lk == 0:  # (FlexAttention fails an internal assert on an empty sequence): the eager path's z
            return build_backend("eager").compute(spec, inputs, dropout)
        if form.differential:
            v = v.repeat(1, 2, 1, 1)  # (B, 2G, Lk, d_v): both maps of a head read the same values
        score_mod = score_mod_for(form, q, Lk)  # from q before the score's query_map, as the eager path
        if "forgetting" in spec.features:  # forgetting attention's D_ij = c_i − c_j, after the terms and the cap
            c = cumulative_log_forget(inputs.transition)  # float32 (the score_mod's scores are): c reaches hundreds
            score_mod = _forgetting_mod(score_mod, c, Lk - Lq)
        block_mask = block_mask_for(pm, B, Hq, Lq, Lk, q.device)
        score: DotProductScore = form.score
        q, k = score.query_map(q), score.key_map(k)
        if score.scale != 1.0:
            q = q * score.scale  # as DotProductScore.forward: on (B, Hq, Lq, d_k), then FlexAttention's scale is 1
        compile_ = bool(spec.config.backend_params.get("compile", self.params["compile"]))
        fn = compiled_flex_attention() if compile_ else flex_attention
        z = fn(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=1.0,
            enable_gqa=spec.key_heads != spec.query_heads,
        )  # (B, Hq, Lq, d_v); a row that sees no key is 0
        return FormOutput(z)
