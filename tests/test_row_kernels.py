"""The C row kernels of attnlab.kernels.sparse (sparsemax, 1.5-entmax, softpick) against references written plainly
here, row by row, in float64, and against the normalizers' PyTorch code in float32.

The references never call attnlab: sparsemax sorts a row and applies Martins & Astudillo (2016, Alg. 1); 1.5-entmax
sorts a row and applies Peters et al. (2019, Alg. 2: τ_ρ of each sorted prefix, the support the number of ρ with
τ_ρ ≤ z_(ρ)); softpick is its textbook formula ReLU(e^s − 1) / (Σ |e^s − 1| + ε). Each decides its support on Python
floats and then computes the weights of that support with torch operations on the row, so that autograd through
the reference gives the gradient that the kernels' backward passes are checked against.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from attnlab.kernels import sparse as sparse_kernel
from attnlab.kernels.rows import RowOp
from attnlab.normalizers import Entmax15, Softpick, Sparsemax, _SoftpickFunction, entmax15, sparsemax

pytestmark = pytest.mark.skipif(not sparse_kernel.available(), reason=f"{sparse_kernel.unavailable_reason()}")

NAMES = ("sparsemax", "entmax15", "softpick")
EPS = 1e-6
LENGTHS = (1, 3, 17, 33, 70)  # Lk: none a multiple of a vector's width but 1


# --------------------------------------------------------------------------------------------- references


def ref_sparsemax(z: Tensor) -> Tensor:
    """Martins & Astudillo (2016), Alg. 1, on one row z (n,): sort descending, k(z) = max{k : 1 + k z_(k) >
    Σ_{j≤k} z_(j)}, τ = (Σ_{j≤k(z)} z_(j) − 1) / k(z); w = [z − τ]₊."""
    values = sorted(z.tolist(), reverse=True)
    cum, best_k, best_cum = 0.0, 0, 0.0
    for k, v in enumerate(values, start=1):
        cum += v
        if 1 + k * v > cum:
            best_k, best_cum = k, cum
    support = z > (best_cum - 1) / best_k
    tau = (z[support].sum() - 1) / support.sum()  # the same τ, as a function of the row
    return torch.clamp(z - tau, min=0)


def ref_entmax15(s: Tensor) -> Tensor:
    """Peters et al. (2019), Alg. 2, on one row s (n,): z = s/2 sorted descending; for each prefix ρ, mean μ_ρ,
    ss_ρ = Σ (z − μ_ρ)², τ_ρ = μ_ρ − √max((1 − ss_ρ)/ρ, 0); the support size is #{ρ : τ_ρ ≤ z_(ρ)}, τ its τ_ρ;
    w = [z − τ]₊²."""
    z = s / 2
    values = sorted(z.tolist(), reverse=True)
    taus = []
    for rho in range(1, len(values) + 1):
        prefix = values[:rho]
        mean = sum(prefix) / rho
        ss = sum((v - mean) ** 2 for v in prefix)
        taus.append(mean - math.sqrt(max((1 - ss) / rho, 0.0)))
    size = sum(1 for rho, v in enumerate(values) if taus[rho] <= v)
    support = z > taus[size - 1]
    zs = z[support]
    k = zs.numel()
    mean = zs.mean()
    tau = mean - torch.sqrt((1 - ((zs - mean) ** 2).sum()) / k)
    return torch.clamp(z - tau, min=0) ** 2


def ref_softpick(s: Tensor, eps: float = EPS) -> Tensor:
    """Zuhri et al. (2025) on one row s (n,): ReLU(e^s − 1) / (Σ |e^s − 1| + ε)."""
    e = torch.exp(s) - 1
    return torch.relu(e) / (e.abs().sum() + eps)


REFERENCES = {"sparsemax": ref_sparsemax, "entmax15": ref_entmax15, "softpick": ref_softpick}


def reference(name: str, logits: Tensor, allowed: Tensor | None) -> Tensor:
    """The reference over every row of logits (B, H, Lq, Lk): the visible keys only; 0 at the others and in rows
    that see none."""
    allowed = torch.ones_like(logits, dtype=torch.bool) if allowed is None else allowed.expand(logits.shape)
    rows = []
    for row, keep in zip(logits.reshape(-1, logits.shape[-1]), allowed.reshape(-1, logits.shape[-1]), strict=True):
        w = torch.zeros_like(row)
        if keep.any():
            w = w.index_put((keep.nonzero().squeeze(-1),), REFERENCES[name](row[keep]))
        rows.append(w)
    return torch.stack(rows).view(logits.shape)


# --------------------------------------------------------------------------------------------- inputs


def make_inputs(
    Lk: int, seed: int, dtype: torch.dtype = torch.float64, softpick: bool = False
) -> tuple[Tensor, Tensor]:
    """logits (2, 3, 6, Lk) with rows of small, unit and large spread, ties at the top, one huge logit, and a
    random mask (2, 1, 6, Lk) with one row that sees no key."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 6, Lk, generator=gen, dtype=dtype)
    x[0, 0] *= 0.05  # nearly uniform rows: large supports
    x[0, 1] *= 20.0  # large spread
    x[1, 0, :, : min(3, Lk)] = x[1, 0].amax(-1, keepdim=True) + 0.25  # ties at the maximum
    x[1, 1, 0, 0] = 300.0 if softpick else 1e4  # one huge logit (e^300 is finite in float64)
    x[1, 2] += 7.0  # shifted rows: τ far from 0
    allowed = torch.rand(2, 1, 6, Lk, generator=gen) > 0.3
    allowed[..., 0] = True
    allowed[1, 0, 2] = False  # a row that sees no key
    return x, allowed


def run_kernel(name: str, logits: Tensor, allowed: Tensor | None) -> Tensor:
    return sparse_kernel.row_normalize(sparse_kernel.SparseRowOp(name, eps=EPS), logits, allowed)


# --------------------------------------------------------------------------------------------- values


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("Lk", LENGTHS)
@pytest.mark.parametrize("masked", [False, True])
def test_kernel_matches_plain_reference_in_float64(name: str, Lk: int, masked: bool) -> None:
    x, allowed = make_inputs(Lk, seed=Lk, softpick=name == "softpick")
    a = allowed if masked else None
    w = run_kernel(name, x, a)
    ref = reference(name, x, a)
    torch.testing.assert_close(w, ref, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(w).all()
    if masked:
        assert (w[~allowed.expand_as(w)] == 0).all()  # exact zeros at hidden keys
        assert (w[1, :, 2] == 0).all()  # the row that sees no key
    if name != "softpick":
        sums = w.sum(-1)
        visible = allowed.expand_as(w).any(-1) if masked else torch.ones_like(sums, dtype=torch.bool)
        torch.testing.assert_close(sums[visible], torch.ones_like(sums[visible]))


@pytest.mark.parametrize("name", ["sparsemax", "entmax15"])
def test_sparse_kernels_give_exact_zeros_and_handle_exact_ties(name: str) -> None:
    # sparsemax of [1, 1, 0, …]: τ = 0.5 (w = ½, ½, 0 …); 1.5-entmax of [2, 2, 0, …]: τ = 1 − √½ (w = ½, ½, 0 …)
    top = 1.0 if name == "sparsemax" else 2.0
    x = torch.zeros(1, 1, 2, 19, dtype=torch.float64)
    x[..., :2] = top
    x[0, 0, 1, 5:] = -30.0
    w = run_kernel(name, x, None)
    expected = torch.zeros_like(x)
    expected[..., :2] = 0.5
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-14)
    assert (w[..., 2:] == 0).all()


def test_softpick_zero_and_negative_logits_get_exact_zeros() -> None:
    x = torch.randn(1, 2, 4, 21, dtype=torch.float64)
    x[..., ::3] = 0.0
    w = run_kernel("softpick", x, None)
    assert (w[x <= 0] == 0).all() and (w[x > 0] > 0).all()
    assert (w.sum(-1) <= 1).all()


@pytest.mark.parametrize("name", NAMES)
def test_kernel_matches_the_pytorch_code_in_float32(name: str) -> None:
    torch_code = {
        "sparsemax": sparsemax,
        "entmax15": entmax15,
        "softpick": lambda x, a: _SoftpickFunction.apply(x, a, EPS),
    }[name]
    x, allowed = make_inputs(77, seed=3, dtype=torch.float32, softpick=name == "softpick")
    x = torch.cat([x, torch.randn(2, 3, 40, 77) * 3], dim=2)  # plus plain random rows
    allowed = torch.cat([allowed, torch.rand(2, 1, 40, 77) > 0.2], dim=2)
    for a in (None, allowed):
        xk, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        wk, wt = run_kernel(name, xk, a), torch_code(xt, a)
        g = torch.randn_like(wk)
        (wk * g).sum().backward()
        (wt * g).sum().backward()
        torch.testing.assert_close(wk, wt, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(xk.grad, xt.grad, rtol=1e-5, atol=2e-6)


# --------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("Lk", [5, 33])
def test_kernel_gradient_matches_autograd_through_reference(name: str, Lk: int) -> None:
    x, allowed = make_inputs(Lk, seed=100 + Lk, softpick=name == "softpick")
    g = torch.randn_like(x)
    for a in (None, allowed):
        xk, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        (run_kernel(name, xk, a) * g).sum().backward()
        (reference(name, xr, a) * g).sum().backward()
        torch.testing.assert_close(xk.grad, xr.grad, rtol=1e-9, atol=1e-11)
        if a is not None:
            assert (xk.grad[~allowed.expand_as(x)] == 0).all()  # no gradient to hidden keys
            assert (xk.grad[1, :, 2] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_kernel_gradcheck(name: str) -> None:
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(1, 2, 3, 9, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    allowed = torch.rand(1, 1, 3, 9, generator=gen) > 0.3
    allowed[..., 0] = True
    op = sparse_kernel.SparseRowOp(name, eps=EPS)
    assert torch.autograd.gradcheck(lambda t: sparse_kernel.row_normalize(op, t, allowed), (x,), eps=1e-7, atol=1e-6)


# --------------------------------------------------------------------------------------------- the RowOp


@pytest.mark.parametrize("name", NAMES)
def test_row_op_works_in_place_and_matches_the_function(name: str) -> None:
    x, allowed = make_inputs(33, seed=5, softpick=name == "softpick")
    op = sparse_kernel.SparseRowOp(name, eps=EPS)
    assert isinstance(op, RowOp)
    buf = x.clone()
    weights, state = op.forward(buf, allowed)
    assert weights.data_ptr() == buf.data_ptr()
    xr = x.clone().requires_grad_()
    wr = run_kernel(name, xr, allowed)
    assert torch.equal(weights, wr)
    g = torch.randn_like(x)
    (wr * g).sum().backward()
    d = g.clone()
    d_logits = op.backward(d, weights, state)
    assert d_logits.data_ptr() == d.data_ptr()
    if name == "softpick":  # in place from R = e / D, out of place from the logits: equal to rounding
        torch.testing.assert_close(d_logits, xr.grad, rtol=1e-12, atol=1e-14)
    else:
        assert torch.equal(d_logits, xr.grad)


@pytest.mark.parametrize("name", NAMES)
def test_results_do_not_depend_on_the_thread_count(name: str) -> None:
    x, allowed = make_inputs(70, seed=9, dtype=torch.float32, softpick=name == "softpick")
    previous = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            xk = x.clone().requires_grad_()
            w = run_kernel(name, xk, allowed)
            w.backward(torch.ones_like(w))
            outs.append((w.detach(), xk.grad))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# --------------------------------------------------------------------------------------------- the normalizers


@pytest.mark.parametrize("cls", [Sparsemax, Entmax15, Softpick])
def test_normalizers_use_the_kernel_and_fall_back_without_it(cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    norm = cls()
    op = norm.row_op()
    assert isinstance(op, sparse_kernel.SparseRowOp) and isinstance(op, RowOp)
    x, allowed = make_inputs(17, seed=11, dtype=torch.float32, softpick=cls is Softpick)
    assert torch.equal(norm(x, allowed), sparse_kernel.row_normalize(op, x, allowed))
    fast = norm(x, allowed)
    monkeypatch.setattr(sparse_kernel, "available", lambda: False)  # as without a compiler
    assert norm.row_op() is None
    torch.testing.assert_close(norm(x, allowed), fast, rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    half = norm(x.to(torch.bfloat16).float(), allowed)  # only float32/64 on the CPU take the kernel
    assert half.dtype == torch.float32


@pytest.mark.parametrize("cls", [Sparsemax, Entmax15, Softpick])
def test_normalizers_under_a_dispatch_mode_use_pytorch(cls: type) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(1, 2, 3, 8, requires_grad=True)
    with FlopCounterMode(display=False):
        w = cls()(x, None)
        w.sum().backward()
    torch.testing.assert_close(w, cls()(x, None), rtol=1e-5, atol=1e-6)
