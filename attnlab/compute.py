"""Compute accounting: what a run costs, in parameters, FLOPs, tokens and the widths that match budgets.

Every run records these in its summary.json (:class:`~attnlab.runs.Summary`):

* ``params``: every parameter; ``params_non_embedding`` (:func:`non_embedding_params`) leaves out the token
  embedding and the learned absolute position table, as Kaplan et al. (2020, "Scaling laws for neural language
  models") count N: "excluding all vocabulary and positional embeddings". Relative-position tables (Shaw's a^K,
  T5's buckets) belong to the attention and are counted.
* ``flops_per_token`` (:func:`step_flops`): the FLOPs of one training step, forward and backward (the optimizer's
  update is not counted), divided by the step's B·L token positions, pads included.
* ``tokens_per_step`` and ``tokens_seen`` (:func:`tokens_per_step`): B·L·(gradient accumulation)·(processes) per
  optimizer step, and that times the steps; nominal, so an epoch's shorter last batch counts as a full one.

The FLOP convention is ``torch.utils.flop_counter.FlopCounterMode``'s: **matrix products only** (mm, addmm, bmm,
baddbmm, convolutions, attention kernels), **2 FLOPs per multiply-add**; softmax, normalisation, activations,
elementwise work and the optimizer are free. Backward counts what autograd runs: for a linear layer the gradients of
its input and its weight (twice its forward). The step is counted by running it, on a copy of the model, under the
counter, so that whatever the backend chooses is what is counted.

**Attention is counted as the model's arithmetic, without recomputation, the same for every backend**: forward
q·kᵀ and P·v (2 products, 2·B·Hq·Lq·Lk·(d_k + d_v)), backward dv = Pᵀ·dO, dP = dO·vᵀ, dq = dS·k and dk = dSᵀ·q
(4 products, twice the forward). That is what the eager path's autograd runs, and what ``biased_softmax``,
``normalized`` and attnlab's relative kernel compute; a fused kernel that recomputes q·kᵀ in its backward pass
(flash attention, FlashAttention-style CPU and CUDA kernels: 5 products, as torch's own formula
``sdpa_backward_flop_count`` counts them) pays that as an implementation detail, not as the model's cost, so the
same model has the same FLOPs/token whichever backend computes it, and adding a position bias never lowers the
count. Grouped-query attention (k and v with Gk < Hq heads) is counted per query head: each query head does its own
products against its group's shared keys. Like torch's, the count ignores a causal mask's sparsity (a causal kernel
does about half the work). Importing this module registers the formulas that make it so, **replacing** torch's where
it has one (``torch.utils.flop_counter.flop_registry``, which ``FlopCounterMode`` copies when it is made):

* SDPA's fused kernels, on the CPU (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) and on
  CUDA (``aten._scaled_dot_product_flash_attention``, ``_scaled_dot_product_efficient_attention``,
  ``_scaled_dot_product_cudnn_attention`` and their backwards): :func:`attention_flops`. (SDPA's math kernel is
  counted through the matrix products it runs, which are the same 2 + 4.) FlexAttention cannot run under a dispatch
  mode here: ``auto`` takes another backend while the counter runs (:mod:`attnlab.backends.flex`), whose count is
  the same.
* attnlab's fused additive kernel (``attnlab::additive_logits``) as the contraction it replaces: logits =
  v·tanh(W q_i + U k_j) is a sum over the attention size d_a for each (i, j), 2·B·H·Lq·Lk·d_a forward and three
  times that backward (the gradients of W q, U k and v; the tanh it evaluates again is elementwise, free).
* the short convolution's and Canon layers' causal depthwise convolution (``attnlab::causal_conv``, shifted
  multiply-adds, :mod:`attnlab.kernels.conv`) as the ``conv1d`` it replaces: 2·B·L·C·k forward, twice that backward.
* attnlab's relative-position kernel (``attnlab::relative_attention``) as its matrix products, q·kᵀ and P·v
  forward, dv, dP, dq and dk backward (:func:`attention_flops`); the bias and the softmax are free, as elsewhere.
  Under a dispatch mode the kernels are called as operators (:mod:`attnlab.kernels.additive`), so the products
  inside the relative kernel are counted once, by this formula.
* attnlab's tiled kernel (``attnlab::tiled_attention``, :mod:`attnlab.kernels.tiled`) the same way: q·kᵀ and P·v
  forward, dv, dP, dq and dk backward; the tiles it recomputes in its backward pass are not counted (as for SDPA).
  Its differential operator (``attnlab::tiled_differential``) counts each map's q·kᵀ and P·v forward, and dv and dP
  once (the combined weights), dq and dk per map backward.

**The decay and delta-rule forms** (:mod:`attnlab.forms.transitions`, computed by :mod:`attnlab.transition`) are
counted through the matrix products of the form a training step runs (the ``chunked`` backend): per chunk P = q kᵀ
⊙ Γ, the delta rule's G = k kᵀ ⊙ Γ and W_k M, the state's reads and writes. With a decay per key channel (GLA's
``gate=channel``, KDA) P and G are built by halving (``_lower_channels``): the diagonal's Σ_c x_ic y_ic and every
block of 2 × 2 and more are matrix products, counted; the 1 × 1 blocks of the first halving are elementwise, free.
The delta rule's unit-triangular solve (``torch.linalg.solve_triangular``, about C²·(d_k + d_v)/2 multiply-adds a
chunk) has no formula in ``FlopCounterMode`` and none here: it is not counted, forward or backward.

:func:`closest_width` is the bisection that ``match.by`` (conf/config.yaml) uses to size a model to a parameter or
state budget.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

import attnlab.kernels.additive  # (defines the operators whose formulas are registered below)
import attnlab.kernels.relative
import attnlab.kernels.tiled  # noqa: F401
from attnlab.kernels.conv import causal_conv_flops
from attnlab.positions import LearnedPositionalEncoding

__all__ = [
    "attention_flops",
    "closest_width",
    "count_flops",
    "non_embedding_params",
    "step_flops",
    "tokens_per_step",
]

aten = torch.ops.aten


def _register(*targets: Any) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """``register_flop_formula(targets)``, **replacing** a formula torch (or this module, on a reload) has for a
    target: every attention operator is counted by this module's convention (the module's docstring)."""
    for target in targets:
        flop_registry.pop(target, None)
    return register_flop_formula(list(targets))


def attention_flops(q_shape: Any, k_shape: Any, v_shape: Any, backward: bool = False) -> int:
    """The matrix products of softmax(q kᵀ + ...) v, without recomputation: q (B, Hq, Lq, d_k), k (B, Gk, Lk, d_k),
    v (B, G, Lk, d_v) (Gk, G dividing Hq: grouped heads are counted per query head) → forward q·kᵀ and P·v,
    2·B·Hq·Lq·Lk·(d_k + d_v); ``backward``: dv, dP, dq and dk, twice that (whatever a kernel recomputes)."""
    B, Hq, Lq, d_k = q_shape
    Gk, Lk = k_shape[-3], k_shape[-2]
    G, Lv, d_v = v_shape[-3:]
    if k_shape[-1] != d_k or Lv != Lk or Hq % Gk or Hq % G:
        raise ValueError(f"attention_flops: q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)} do not fit")
    products = 2 * B * Hq * Lq * Lk * (d_k + d_v)
    return 2 * products if backward else products


SDPA_FORWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
)
"""SDPA's fused kernels (CPU flash; CUDA flash, memory-efficient, cuDNN): q, k, v their first arguments."""
SDPA_BACKWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
)
"""Their backward passes: dO, q, k, v their first arguments."""


@_register(*SDPA_FORWARD)
def _sdpa_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    return attention_flops(query_shape, key_shape, value_shape)


@_register(*SDPA_BACKWARD)
def _sdpa_backward_flops(
    grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any
) -> int:
    return attention_flops(query_shape, key_shape, value_shape, backward=True)


def additive_flops(wq_shape: Any, uk_shape: Any) -> int:
    """The additive kernel's forward: 2·B·H·Lq·Lk·d_a (wq (B, H, Lq, d_a), uk (B, H, Lk, d_a))."""
    B, H, Lq, A = wq_shape
    return 2 * B * H * Lq * uk_shape[2] * A


@_register(torch.ops.attnlab.additive_logits)
def _additive_forward_flops(wq_shape: Any, uk_shape: Any, v_shape: Any, *args: Any, **kwargs: Any) -> int:
    return additive_flops(wq_shape, uk_shape)


@_register(torch.ops.attnlab.additive_logits_backward)
def _additive_backward_flops(
    grad_shape: Any, wq_shape: Any, uk_shape: Any, v_shape: Any, *args: Any, **kwargs: Any
) -> int:
    return 3 * additive_flops(wq_shape, uk_shape)


def relative_flops(q_shape: Any, k_shape: Any, v_shape: Any, backward: bool = False) -> int:
    """The relative kernel's matrix products (heads expanded: q, k (B, H, L, d), v (B, H, Lk, d_v)): q·kᵀ and P·v
    forward, dv, dP, dq and dk backward: :func:`attention_flops`."""
    return attention_flops(q_shape, k_shape, v_shape, backward)


# the relative and tiled kernels take q, k, v first (their backwards dz, then q, k, v): the same count
@_register(torch.ops.attnlab.relative_attention, torch.ops.attnlab.tiled_attention)
def _relative_forward_flops(q_shape: Any, k_shape: Any, v_shape: Any, *args: Any, **kwargs: Any) -> int:
    return relative_flops(q_shape, k_shape, v_shape)


@_register(torch.ops.attnlab.relative_attention_backward, torch.ops.attnlab.tiled_attention_backward)
def _relative_backward_flops(dz_shape: Any, q_shape: Any, k_shape: Any, v_shape: Any, *args: Any, **kwargs: Any) -> int:
    return relative_flops(q_shape, k_shape, v_shape, backward=True)


@_register(torch.ops.attnlab.tiled_differential)
def _differential_forward_flops(q_shape: Any, k_shape: Any, q2_shape: Any, k2_shape: Any, v_shape: Any, *args: Any,
                                **kwargs: Any) -> int:  # fmt: skip
    """Differential attention in the tiled kernel, forward: each map's q·kᵀ and P·v (two passes)."""
    return 2 * attention_flops(q_shape, k_shape, v_shape)


@_register(torch.ops.attnlab.tiled_differential_backward)
def _differential_backward_flops(dz_shape: Any, q_shape: Any, k_shape: Any, q2_shape: Any, k2_shape: Any,
                                 v_shape: Any, *args: Any, **kwargs: Any) -> int:  # fmt: skip
    """Its backward, one pass over both maps: dv and dP once (on the combined weights, as eager's autograd), dq
    and dk per map: 2·B·H·Lq·Lk·(2·d_v + 4·d_k)."""
    B, H, Lq, d_k = q_shape
    return 2 * B * H * Lq * k_shape[-2] * (2 * v_shape[-1] + 4 * d_k)


@_register(torch.ops.attnlab.causal_conv)
def _causal_conv_flops(x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
    return causal_conv_flops(x_shape, w_shape)


@_register(torch.ops.attnlab.causal_conv_backward)
def _causal_conv_backward_flops(g_shape: Any, x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
    return 2 * causal_conv_flops(x_shape, w_shape)


# ---------------------------------------------------------------------------------------------------- counting


def count_flops(fn: Callable[[], Any]) -> int:
    """The FLOPs of ``fn()`` (matrix products, 2 per multiply-add), with this module's formulas."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def step_flops(
    module: Any,
    batch_size: int,
    seq_len: int,
    device: torch.device | str | None = None,
    context: Callable[[], AbstractContextManager[Any]] | None = None,
) -> int:
    """The FLOPs of one training step (forward and backward of the loss) of the
    :class:`~attnlab.module.EncoderModule` ``module`` on a (``batch_size``, ``seq_len``) batch: counted on a copy
    in training mode, on ``device`` (default: the module's), inside ``context()`` (e.g. the trainer's precision),
    with random tokens and labels of the task's shape, under a forked random state: the module, its gradients and
    the random numbers of training are as they were."""
    hp = module.hparams
    device = torch.device(device) if device is not None else next(module.parameters()).device
    forked: dict[str, Any] = {"devices": []} if device.type != "cuda" else {"devices": [device], "device_type": "cuda"}
    with torch.random.fork_rng(**forked):
        twin = copy.deepcopy(module).to(device).train()
        for parameter in twin.parameters():
            parameter.grad = None
        tokens = torch.randint(0, int(hp["vocab_size"]), (batch_size, seq_len), device=device)
        shape = (batch_size, seq_len) if hp["per_token"] else (batch_size,)
        labels = torch.randint(0, int(hp["num_classes"]), shape, device=device)

        def step() -> None:
            with context() if context is not None else nullcontext():
                loss = twin._loss((tokens, labels))[0]
            loss.backward()

        return count_flops(step)


def non_embedding_params(module: nn.Module) -> int:
    """The parameters of ``module`` outside its ``nn.Embedding`` modules (the token embedding) and learned absolute
    position tables (:class:`~attnlab.positions.LearnedPositionalEncoding`): Kaplan et al.'s N."""
    tables = [m for m in module.modules() if isinstance(m, nn.Embedding | LearnedPositionalEncoding)]
    embedded = {id(p) for m in tables for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in embedded)


def tokens_per_step(batch_size: int, seq_len: int, world_size: int = 1, accumulate: int = 1) -> int:
    """Token positions (pads included) of one optimizer step: B·L per batch, ``accumulate`` batches per process,
    ``world_size`` processes."""
    return int(batch_size) * int(seq_len) * int(accumulate) * int(world_size)


# ---------------------------------------------------------------------------------------------------- matching


class Unreachable(ValueError):
    """No width gives a count near the target: the message says why (one line)."""


def closest_width(count: Callable[[int], int], target: int, low: int = 1, high: int = 1 << 24) -> tuple[int, int]:
    """(width, count(width)) for the integer width in [``low``, ``high``] whose ``count`` is closest to ``target``
    (the smaller width on a tie), assuming ``count`` does not decrease as the width grows: doubling from ``low``
    until the count reaches the target, then bisection. :class:`Unreachable` when even ``count(low)`` exceeds the
    target, or ``count(high)`` falls short of it."""
    first = count(low)
    if first >= target:
        if first > target:
            raise Unreachable(f"the smallest width ({low}) already gives {first:,}, more than {target:,}")
        return low, first
    lo, lo_count, hi = low, first, low
    while True:  # count(lo) < target
        hi = min(2 * hi, high)
        hi_count = count(hi)
        if hi_count >= target:
            break
        if hi >= high:
            if hi_count == first:
                raise Unreachable(f"it does not change with the width ({first:,} at every width up to {high:,})")
            raise Unreachable(f"widths up to {high:,} give at most {hi_count:,}")
        lo, lo_count = hi, hi_count
    while hi - lo > 1:  # count(lo) < target <= count(hi)
        mid = (lo + hi) // 2
        mid_count = count(mid)
        if mid_count >= target:
            hi, hi_count = mid, mid_count
        else:
            lo, lo_count = mid, mid_count
    return (lo, lo_count) if target - lo_count <= hi_count - target else (hi, hi_count)
