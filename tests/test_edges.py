"""Kernels at the edges (issue 60): every backend at the limits of its inputs, generated from the registries.

* Large logits: the tiled kernel's normalizers (softmax, softmax1, sink, sigmoid; with soft-capping too) are finite
  wherever the eager path is, forward and backward, for logits up to ±1e4 (its sigmoid was 1 / (1 + e^{−x}), which
  overflowed to NaN), and equal to the eager normalizers there in float64.
* An empty sequence: every registered backend, with every normalizer, position bias, soft-capping and differential
  attention it computes, gives (B, 0, d_model) at L = 0, and a zero gradient.
* A row that sees no key (a batch element whose keys are all padding, a custom mask with an all-False row): a
  finite output, the eager path's (zero weights: the output projection's bias), and no gradient from that row,
  on every backend that takes the layer.

A combination a backend refuses (building the layer with it forced raises ValueError; a call's conditions it cannot
run under: no gradients, another device) is passed over. The inputs are fresh for every run (the layers' parameters
too): a failure's message names the run's seed, which ``ATTNLAB_EDGES_SEED=<seed>`` repeats. Values are compared
with the eager path in float64.
"""

from __future__ import annotations

import os
import random
import zlib
from typing import Any

import pytest
import torch
from helpers import LINEAR_NORMALIZERS, NORMALIZERS, POSITION_BIASES, params_of

import attnlab
from attnlab.backends import Conditions, build_backend, list_backends
from attnlab.kernels import tiled
from attnlab.kernels.tiled import KeyRange, tiled_attention

pytestmark = pytest.mark.usefixtures("single_thread")

BACKENDS = tuple(list_backends())
D_MODEL, HEADS, D_K = 16, 2, 4
TILED_NORMALIZERS = ("softmax", "softmax1", "sink", "sigmoid")
needs_tiled = pytest.mark.skipif(not tiled.available(), reason="the tiled kernel cannot be built here")


SEED = int(os.environ.get("ATTNLAB_EDGES_SEED") or random.SystemRandom().randrange(2**31))
"""This run's seed: a new one each run unless ``ATTNLAB_EDGES_SEED`` gives it."""


def seeded(*key: Any) -> str:
    """Seed torch's global generator from the run's seed and ``key`` (the same draws whatever ran before) → the
    words that name the seed in a failure's message."""
    torch.default_generator.manual_seed(zlib.crc32(repr((SEED, *key)).encode()))  # (the CPU's: no device's stack)
    return f"ATTNLAB_EDGES_SEED={SEED}"


def layer_options() -> list[tuple[str, dict[str, Any]]]:
    """(id, layer options): every registered normalizer (a linear one with the linear score), every position bias,
    soft-capping, differential attention, and the tiled kernel's normalizers with a bias, the cap and both maps."""
    cases: list[tuple[str, dict[str, Any]]] = []
    for name in NORMALIZERS:
        extra = {"score": "linear"} if name in LINEAR_NORMALIZERS else {}
        cases.append((f"normalizer={name}", {"normalizer": name, **extra}))
    for name in POSITION_BIASES:
        if name != "none":
            cases.append((f"position_bias={name}", bias_options(name)))
    cases.append(("softcap", {"softcap": 5.0}))
    cases.append(("differential", {"differential": True}))
    for name in TILED_NORMALIZERS[1:]:
        cases.append((f"{name}+alibi+softcap", {"normalizer": name, "softcap": 5.0, **bias_options("alibi")}))
        cases.append((f"{name}+differential+t5", {"normalizer": name, "differential": True, **bias_options("t5")}))
    return cases


def bias_options(name: str) -> dict[str, Any]:
    return {"position_bias": name, "position_bias_params": params_of("position_bias", name)}


OPTIONS = dict(layer_options())
_LAYERS: dict[tuple[Any, ...], attnlab.MultiHeadAttention | None] = {}


def layer(backend: str, label: str, mask: str | None, compiled: bool = True) -> attnlab.MultiHeadAttention | None:
    """:func:`build` of the layer options ``label``, once per run (the tests below share them; none changes a
    parameter)."""
    key = (backend, label, mask, compiled)
    if key not in _LAYERS:
        seeded("layer", *key)
        _LAYERS[key] = build(backend, OPTIONS[label], mask, compiled)
    return _LAYERS[key]


def build(
    backend: str, options: dict[str, Any], mask: str | None = None, compiled: bool = True
) -> attnlab.MultiHeadAttention | None:
    """The float64 layer with ``backend`` forced and its parameters moved off their initial values (a sink, a T5
    table, λ), or None where the backend (or the layer) refuses this configuration. ``compiled=False``: a backend
    that compiles (``compile`` among its parameters: flex) does not."""
    if not compiled and "compile" in build_backend(backend).params:
        options = {**options, "backend_params": {"compile": False}}
    try:
        mha = attnlab.MultiHeadAttention(D_MODEL, HEADS, D_K, mask=mask, backend=backend, **options)
    except ValueError as e:
        assert "\n" not in str(e)  # a refusal is one line
        return None
    with torch.no_grad():
        for p in mha.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return mha.double()


def conditions(mha: attnlab.MultiHeadAttention, mask: Any, length: int) -> tuple[torch.dtype, bool] | None:
    """(dtype, gradients) of the first CPU call the layer's backend runs: float64 with gradients, else float32, else
    without gradients (CPU FlexAttention is forward-only); None where it runs none (a GPU-only backend)."""
    pm = attnlab.prepare_mask(mask, length, length, "cpu")
    form = "none" if pm is None else pm.form
    backend = build_backend(mha.config.backend)
    for grad in (True, False):
        for dtype in (torch.float64, torch.float32):
            when = Conditions(device="cpu", dtype=dtype, need_weights=False, training=True, grad=grad, mask=form)
            if backend.call_reason(mha.spec, when) is None:
                return dtype, grad
    return None


def mask_cases(length: int) -> dict[str, tuple[Any, Any]]:
    """name → (the layer's configured mask, the mask of the call) for B = 2 sequences of ``length``: none, causal,
    key padding (sequence 1 all padding: none of its rows sees a key), causal + padding (also the first rows of
    sequence 0), causal with a row that sees nothing (rows as intervals: the tiled kernel reads them as such), and a
    random mask with an all-False row."""
    keys = torch.ones(2, 1, 1, length, dtype=torch.bool)
    keys[1] = False
    keys[0, ..., :2] = False
    causal = attnlab.build_mask("causal")
    hole = torch.ones(length, length, dtype=torch.bool).tril()
    scattered = torch.rand(length, length) < 0.5
    if length:
        hole[length // 2] = False
        scattered[length // 3] = False
    return {
        "none": (None, None),
        "causal": ("causal", causal),
        "padding": (None, keys),
        "causal+padding": ("causal", causal.prepare(length, length, "cpu").with_key_padding(keys)),
        "causal_hole": ("causal", hole),
        "scattered_hole": (None, scattered),
    }


def empty_rows(mask: Any, length: int) -> torch.Tensor:
    """(B, L) True for the query rows that see no key under the call's mask."""
    pm = attnlab.prepare_mask(mask, length, length, "cpu")
    allowed = torch.ones(1, 1, length, length, dtype=torch.bool) if pm is None else pm.allowed
    return ~allowed.expand(2, -1, length, length).any(-1).any(1)


def gradients(out: torch.Tensor, c: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """∂⟨out, c⟩/∂ each input, zeros where it does not reach one."""
    grads = torch.autograd.grad((out * c).sum(), inputs, allow_unused=True, materialize_grads=True, retain_graph=True)
    return list(grads)


# ------------------------------------------------------------------------------------ large logits, tiled kernel


def _dense_reference(q, k, v, scale, allowed, normalizer, softcap):
    logits = scale * q @ k.transpose(-1, -2)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return normalizer(logits, allowed) @ v


@needs_tiled
@pytest.mark.parametrize("softcap", [None, 50.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("name", [*TILED_NORMALIZERS, "sigmoid_bias"])
def test_the_tiled_kernel_is_finite_and_exact_at_logits_of_1e4(name, softcap):
    """Logits scaled to reach ±1e4, under causal + key padding (the first rows of sequence 1 see no key): float64
    equals the eager normalizer applied to the dense logits, outputs and the gradients of q, k, v (and the sink);
    float32 is finite, forward and backward, as the eager path is."""
    seed = seeded("kernel", name, softcap)
    B, H, L, d = 2, 2, 37, 8
    q64, k64, v64 = (torch.randn(B, H, L, d, dtype=torch.float64) for _ in range(3))
    scale = 1e4 / float((q64 @ k64.transpose(-1, -2)).abs().amax())
    keys = torch.ones(B, L, dtype=torch.bool)
    keys[1, :3] = False
    keys[0, -5:] = False
    lo, hi = torch.zeros(L, dtype=torch.int64), torch.arange(1, L + 1)
    allowed = torch.ones(L, L, dtype=torch.bool).tril() & keys[:, None, None, :]  # (B, 1, L, L)
    kernel: dict[str, Any] = {"keys": KeyRange(lo, hi, keys), "softcap": softcap}
    if name in ("sigmoid", "sigmoid_bias"):
        bias = -2.0 if name == "sigmoid_bias" else None
        normalizer = attnlab.build_normalizer("sigmoid", bias=bias)
        kernel.update(normalizer="sigmoid", sigmoid_bias=bias)
    else:
        normalizer = attnlab.build_normalizer(name, num_heads=H)
        if name == "sink":
            with torch.no_grad():
                normalizer.sink_logit.copy_(torch.randn(H) * 3)
    for dtype in (torch.float64, torch.float32):
        normalizer = normalizer.to(dtype)
        q, k, v = (t.to(dtype).requires_grad_() for t in (q64, k64, v64))
        params = [q, k, v, *normalizer.parameters()]
        extra = normalizer.extra_logit()  # softmax1: 0; sink: the learned logit per head
        sink = None if extra is None else extra.to(dtype).expand(H)
        z = tiled_attention(q, k, v, scale, sink=sink, **kernel)
        c = torch.randn_like(z)
        got = gradients(z, c, params)
        where = f"{name} {softcap=} {dtype} {seed}"
        if dtype == torch.float32:
            assert torch.isfinite(z).all(), f"non-finite output: {where}"
            assert all(torch.isfinite(g).all() for g in got), f"non-finite gradient: {where}"
            continue
        ref = _dense_reference(q, k, v, scale, allowed, normalizer, softcap)
        want = gradients(ref, c, params)
        assert torch.isfinite(ref).all() and all(torch.isfinite(g).all() for g in want)  # (eager is finite here)
        torch.testing.assert_close(z, ref, rtol=1e-9, atol=1e-9, msg=lambda m, where=where: f"{where}: {m}")
        for g, w in zip(got, want, strict=True):
            tol = 1e-9 * max(1.0, float(w.abs().amax()))
            torch.testing.assert_close(
                g, w, rtol=1e-7, atol=tol, msg=lambda m, where=where: f"{where} (gradients): {m}"
            )


@needs_tiled
@pytest.mark.parametrize("scale", [10.0, 100.0])
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("name", TILED_NORMALIZERS)
def test_the_tiled_backend_is_finite_where_eager_is_on_large_inputs(name, softcap, scale):
    """The issue's layer: ``MultiHeadAttention(32, 2, normalizer=…, backend="tiled")`` on scale · N(0, 1) inputs
    (B 2, L 19: sigmoid gave NaN rows at ×10, every row at ×100): finite in float32 where eager is, forward and
    backward; equal to eager in float64."""
    seed = seeded("layer", name, softcap, scale)
    tiled_layer = attnlab.MultiHeadAttention(32, 2, normalizer=name, softcap=softcap, backend="tiled")
    eager_layer = attnlab.MultiHeadAttention(32, 2, normalizer=name, softcap=softcap, backend="eager")
    eager_layer.load_state_dict(tiled_layer.state_dict())
    x32 = scale * torch.randn(2, 19, 32)
    where = f"{name} {softcap=} x{scale:g} {seed}"
    for dtype in (torch.float32, torch.float64):
        layers = [m.to(dtype) for m in (tiled_layer, eager_layer)]
        outs, grads = [], []
        for m in layers:
            x = x32.to(dtype).requires_grad_()
            y = m(x)[0]
            outs.append(y)
            grads.append(gradients(y, torch.ones_like(y), [x, *m.parameters()]))
        (got, ref), (got_g, ref_g) = outs, grads
        if dtype == torch.float32:
            assert torch.isfinite(ref).all() and all(torch.isfinite(g).all() for g in ref_g)
            assert torch.isfinite(got).all(), f"NaN rows: {where}"
            assert all(torch.isfinite(g).all() for g in got_g), f"non-finite gradient: {where}"
            continue
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9, msg=lambda m, where=where: f"{where}: {m}")
        for g, w in zip(got_g, ref_g, strict=True):
            tol = 1e-11 * scale**2 * max(1.0, float(w.abs().amax()))  # (logits ~ scale²: their rounding)
            torch.testing.assert_close(
                g, w, rtol=1e-7, atol=tol, msg=lambda m, where=where: f"{where} (gradients): {m}"
            )


# ------------------------------------------------------------------------------------ the empty sequence


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_gives_an_empty_output_and_a_zero_gradient_at_length_0(backend):
    """(B, 0, d_model) at L = 0 with every form the backend computes, for no mask, a causal one and key padding;
    the gradient of the input and of every parameter is zero."""
    seed = seeded("length 0", backend)
    masks = mask_cases(0)
    failures, ran = [], 0
    for label in OPTIONS:
        for mask_name in ("none", "causal", "padding"):
            config_mask, mask = masks[mask_name]
            mha = layer(backend, label, config_mask)
            when = None if mha is None else conditions(mha, mask, 0)
            if when is None:
                continue
            dtype, grad = when
            mha = mha.to(dtype)
            seeded("length 0", backend, label, mask_name)
            x = torch.randn(2, 0, D_MODEL, dtype=dtype, requires_grad=grad)
            try:
                with torch.set_grad_enabled(grad):
                    out, _ = mha(x, mask=mask)
                    ran += 1
                    assert out.shape == (2, 0, D_MODEL), f"shape {tuple(out.shape)}"
                    if grad:
                        params = [x, *mha.parameters()]
                        gs = gradients(out, torch.ones_like(out), params)
                        assert all(g.shape == p.shape and not g.any() for g, p in zip(gs, params, strict=True))
            except Exception as e:  # (every combination's failure, in one report)
                failures.append(f"{label}, mask={mask_name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    if not ran:
        pytest.skip(f"{backend} computes none of these layers on the CPU")
    assert not failures, f"{backend} at L = 0 ({seed}):\n" + "\n".join(failures)


# ------------------------------------------------------------------------------------ rows that see no key


def _check_empty_rows(backend: str, only_no_grad: bool) -> tuple[int, list[str], str]:
    """(layers run, failures, the seed's words) over every layer option and mask with rows that see no key that
    ``backend`` computes with gradients on the CPU (``only_no_grad``: those it computes only without)."""
    seed = seeded("empty rows", backend)
    L = 7
    masks = {name: m for name, m in mask_cases(L).items() if name not in ("none", "causal")}
    failures, ran = [], 0
    for label in OPTIONS:
        for mask_name, (config_mask, mask) in masks.items():
            mha = layer(backend, label, config_mask, compiled=not only_no_grad)
            when = None if mha is None else conditions(mha, mask, L)
            if when is None or (not when[1]) != only_no_grad:
                continue
            dtype, grad = when
            mha = mha.to(dtype)
            empty = empty_rows(mask, L)
            assert empty.any()
            seeded("empty rows", backend, label, mask_name)
            try:
                with torch.set_grad_enabled(grad):
                    x = torch.randn(2, L, D_MODEL, dtype=dtype, requires_grad=grad)
                    got, _ = mha(x, mask=mask)
                    ref = mha.attend(x, mask=mask).out
                    ran += 1
                    assert torch.isfinite(got).all(), "a non-finite output"
                    bias = mha.out_proj.bias.detach().expand(int(empty.sum()), -1)
                    assert torch.equal(got[empty].detach(), bias), "a row that sees no key is not out_proj(0)"
                    tol = 1e-9 if dtype == torch.float64 else 1e-4
                    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
                    if grad:  # no gradient from the empty rows, but the output projection's bias
                        c = torch.randn_like(got) * empty[..., None]
                        params = [x, *(p for n, p in mha.named_parameters() if n != "out_proj.bias")]
                        gs = gradients(got, c, params)
                        assert all(torch.isfinite(g).all() for g in gs), "a non-finite gradient"
                        assert not any(g.any() for g in gs), "a gradient flows from a row that sees no key"
                        c = torch.randn_like(got)
                        for g, w in zip(gradients(got, c, params), gradients(ref, c, params), strict=True):
                            torch.testing.assert_close(g, w, rtol=tol * 10, atol=tol * 10)
            except Exception as e:  # (every combination's failure, in one report)
                failures.append(f"{label}, mask={mask_name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return ran, failures, seed


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_that_sees_no_key_is_finite_with_no_gradient_on_every_backend(backend):
    """Key padding hiding every key of one batch element, causal + padding, a causal mask and a random one with an
    all-False row: the output is finite and the eager path's (zero weights: the output projection's bias at that
    row), and no gradient flows from that row to the input or to any parameter; the whole output and its
    gradients equal eager's. Backends that run here only without gradients: the test below."""
    ran, failures, seed = _check_empty_rows(backend, only_no_grad=False)
    if not ran:
        pytest.skip(f"{backend} computes none of these layers with gradients on the CPU (the slow test: without)")
    assert not failures, f"{backend}, rows that see no key ({seed}):\n" + "\n".join(failures)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_that_sees_no_key_is_finite_on_the_forward_only_backends(backend):
    """As above for the backends that run on the CPU without gradients only (FlexAttention, uncompiled: still
    slow on the CPU): the output is finite and eager's."""
    ran, failures, seed = _check_empty_rows(backend, only_no_grad=True)
    if not ran:
        pytest.skip(f"{backend} is not a forward-only backend on the CPU")
    assert not failures, f"{backend}, rows that see no key ({seed}):\n" + "\n".join(failures)
