"""Backends: what computes a layer's attention, chosen in one place.

Each backend is a registered :class:`Backend` that says whether it can compute a layer
(:meth:`Backend.supports` → None, or the reason it cannot, one line) and computes it
(:meth:`Backend.attend`: the layer's input → its output). :func:`choose_backend` picks, for a layer and the
conditions of a call (device, dtype, weights asked for, training, gradients), the layer's forced backend
(``AttentionConfig.backend``), or else the first of :data:`ORDER` that supports it:

==================  =====================================================================  ======================
backend             computes                                                               when
==================  =====================================================================  ======================
``tiled``           attnlab's tiled C kernel (FlashAttention-2 on the CPU, no (L, L)       CPU, f32/64; a plain
                    tensor): a dot-product score with a bias over offsets (T5, ALiBi,       softmax with no mask or
                    Shaw's key term), soft-capping, softmax / softmax1 / sink / sigmoid,    a causal one is sdpa's
                    differential maps, masks as key intervals + key padding
                    (:mod:`attnlab.backends.tiled`)
``relative``        attnlab's fused C kernel for one learned relative-position table       CPU, training, f32/64
                    (Shaw, T5) beside a dot-product score (:mod:`attnlab.kernels.relative`)
``biased_softmax``  softmax(scale·q kᵀ + bias) v with a learned bias, in fewer passes than  CPU, gradients on
                    SDPA's math kernel (:class:`~attnlab.backends.sdpa.BiasedSoftmaxAttention`);
                    selective attention's F as that bias (C scan, C softmax row kernel)
``flex``            compiled FlexAttention: dot-product scores, a position bias as a       CUDA: a bias, a cap,
                    score_mod (Shaw, T5, ALiBi), soft-capping, any mask as a cached        other masks; CPU:
                    BlockMask, GQA (:mod:`attnlab.backends.flex`)                          forced, no_grad only
``sdpa``            ``torch.nn.functional.scaled_dot_product_attention``: dot-product       no weights asked for
                    scores, position bias and mask as one float mask, softmax (a sink as
                    one more key), grouped heads through ``enable_gqa``; forgetting
                    attention's bias folded into q and k (two more dimensions)
``chunked``         a form's O(L) chunked form (linear attention, the decay and delta-rule    causal (+ padding)
                    forms: any form tagged ``recurrent``), O(L·C) memory
                    (:mod:`attnlab.backends.linear`)
``global``          linear attention without a mask: φ(Q) (φ(K)ᵀ V), O(L)                  none, padding
``normalized``      soft-capped softmax (attnlab's C row kernel) or a normalizer's row     CPU, f32/64, no
                    operation (sparsemax, entmax15, softpick), in one autograd function    dropout
                    (:mod:`attnlab.backends.normalized`)
``eager``           every stage in turn, materialising (B, H, Lq, Lk): the reference, and   always
                    what the diagnostics read (it returns the weights)
``recurrent``       a form tagged ``recurrent`` one token at a time (forced only)           causal (+ padding)
==================  =====================================================================  ======================

The additive score's fused C kernel is the score's own choice inside any backend (``variant.params.kernel``).
A call that asks for the weights (``need_weights=True``, the diagnostics) always runs ``eager``, whatever the
layer's backend. A forced backend that cannot compute the layer's configuration is refused when the layer is built
(one line); one that cannot run under a call's conditions (a CPU kernel on a GPU) raises at that call. A call's dtype
is the one its products compute in (:func:`compute_dtype`): under autocast (``trainer.precision=bf16-mixed``), the
autocast dtype, not the input's float32, so ``auto`` passes over the float32/64-only kernels (``relative``,
``normalized``); :func:`attnlab.training.config.validate_config` refuses a forced one before a run starts.

Register a backend with ``@register_backend("name")`` on a :class:`Backend` subclass; ``position=`` puts it into
the automatic order (before ``eager``, by default), so that ``auto`` chooses it where it applies.
"""

from attnlab.backends.base import (  # noqa: F401  (for code that reads them here)
    _BACKENDS,
    _INSTANCES,
    FEATURE_REASONS,
    FLOAT32_64,
    ORDER,
    PRECISION_DTYPES,
    Backend,
    Conditions,
    LayerSpec,
    _candidates,
    build_backend,
    check_backend_params,
    choose_backend,
    compute_dtype,
    dtype_reason,
    list_backends,
    missing_feature,
    precision_dtype,
    register_backend,
    spec_of,
)

__all__ = [
    "FEATURE_REASONS",
    "ORDER",
    "Backend",
    "Conditions",
    "LayerSpec",
    "build_backend",
    "check_backend_params",
    "choose_backend",
    "compute_dtype",
    "dtype_reason",
    "list_backends",
    "missing_feature",
    "precision_dtype",
    "register_backend",
    "spec_of",
]

from attnlab.backends import eager, flex, linear, normalized, relative, sdpa, tiled  # noqa: F401  (registration)

# the most specific first
ORDER[:] = ["tiled", "relative", "biased_softmax", "flex", "sdpa", "chunked", "global", "normalized", "eager"]
