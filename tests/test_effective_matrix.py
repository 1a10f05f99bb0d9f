"""The effective matrix (``attnlab.transition.effective_matrix``, the weights of the eager backend, o = A v) keeps
float32's precision as the gates forget: A @ v and its gradients w.r.t. every leaf equal a plain float64 loop written
here, within a tolerance that the matrix built on the whole sequence's cumulative log-decay b (the form before issue
60) misses: b_i − b_j, two float32 sums of order L·|log α|, keeps few digits of their difference. Per-head and
per-channel decays, with and without the delta rule's β, DeltaProduct's two steps a token and RWKV-7's diagonal plus
low rank, at L 1024 with gates near 0 (log α ∈ (−20, −5)), and two cases with gates near 1 (log α ∈ (−0.05, −0.001)).
The measured errors are in the tolerances' docstrings.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.transition import Transition, effective_matrix

pytestmark = pytest.mark.usefixtures("single_thread")

B, H, L, DK, DV = 1, 2, 1024, 8, 4
VALUE_TOL = 4e-7
"""max |o − o_loop| / max(1, max |o_loop|): chunk-local 1.1e-7 … 1.6e-7 forgetting, 2.2e-7 … 2.4e-7 keeping; on the
whole sequence's b 7.4e-7 … 1.1e-6 forgetting, 8.4e-7 … 9.0e-7 keeping."""
GRAD_TOL = 3e-6
"""Over the leaves, max |∂ − ∂_loop| / max(1, max |∂_loop|): chunk-local 0.4e-6 … 1.6e-6; on the whole sequence's b
6.2e-6 … 1.6e-5 forgetting (keeping: 1.1e-6 … 1.6e-6, both pass)."""

CASES = {
    # name: (per_channel, use_beta, householder_steps, low_rank)
    "head": (False, False, 1, False),
    "channel": (True, False, 1, False),
    "head-delta": (False, True, 1, False),
    "channel-delta": (True, True, 1, False),
    "head-deltaproduct-2": (False, True, 2, False),
    "channel-low-rank": (True, False, 1, True),
}


def gates(shape: tuple[int, ...], gen: torch.Generator, keeping: bool = False) -> torch.Tensor:
    """log α ∈ (−20, −5) (gates near 0, strongly forgetting), or with ``keeping`` ∈ (−0.05, −0.001) (gates near 1),
    float64."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    return -(1e-3 + 0.049 * u) if keeping else -5.0 - 15.0 * u


def leaves(case: str, seed: int = 0) -> dict[str, torch.Tensor]:
    keeping = case.endswith("-keeping")
    per_channel, use_beta, n, low_rank = CASES[case.removesuffix("-keeping")]
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    out = {
        "q": randn(B, H, L, DK),
        "k": F.normalize(randn(B, H, L * n, DK), dim=-1),
        "v": randn(B, H, L * n, DV),
        "log_decay": gates((B, H, L, DK) if per_channel else (B, H, L), gen, keeping),
    }
    if use_beta:
        out["beta"] = torch.rand(B, H, L * n, generator=gen, dtype=torch.float64)
    if low_rank:  # RWKV-7's a = −κ̂, b = κ̂ ⊙ a_t (a_t ∈ (0, 1))
        kappa = F.normalize(randn(B, H, L, DK), dim=-1)
        out["a"] = -kappa
        out["b"] = kappa * torch.rand(B, H, L, DK, generator=gen, dtype=torch.float64)
    return out


def steps(case: str) -> int:
    return CASES[case.removesuffix("-keeping")][2]


def record(case: str, t: dict[str, torch.Tensor]) -> Transition:
    n = steps(case)
    low_rank = (t["a"], t["b"]) if "a" in t else None
    return Transition(t["log_decay"], t.get("beta"), low_rank, n)


def plain_loop(case: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The recurrence token by token, written out: M ← (diag(α) + b aᵀ) M, then M ← M + k (β (v − Mᵀ k))ᵀ for each
    of the token's n steps (M + k vᵀ without β), o = Mᵀ q. Rows and columns as (…, 1, d) and (…, d, 1) matrices;
    the tokens taken by unbind (an index's backward would write a zero tensor of the whole sequence each token)."""
    n = steps(case)
    alpha = t["log_decay"].exp()
    alpha = alpha.unsqueeze(-1) if alpha.dim() == 4 else alpha[..., None, None]  # (B, H, L, d_k or 1, 1)
    tokens = {
        "q": t["q"].unsqueeze(-2).unbind(2),  # L × (B, H, 1, d_k)
        "alpha": alpha.unbind(2),
        "k_col": t["k"].unsqueeze(-1).unbind(2),  # L·n × (B, H, d_k, 1)
        "k_row": t["k"].unsqueeze(-2).unbind(2),
        "v": t["v"].unsqueeze(-2).unbind(2),  # L·n × (B, H, 1, d_v)
    }
    if "beta" in t:
        tokens["beta"] = t["beta"][..., None, None].unbind(2)
    if "a" in t:
        tokens["a"], tokens["b"] = t["a"].unsqueeze(-2).unbind(2), t["b"].unsqueeze(-1).unbind(2)
    M = t["q"].new_zeros(B, H, DK, DV)
    outs = []
    for i in range(L):
        read = None if "a" not in t else tokens["a"][i] @ M  # aᵀ M_{t−1}: (B, H, 1, d_v)
        M = tokens["alpha"][i] * M
        if read is not None:
            M = M + tokens["b"][i] @ read
        for s in range(i * n, (i + 1) * n):
            u = tokens["v"][s]
            if "beta" in t:
                u = tokens["beta"][s] * (u - tokens["k_row"][s] @ M)
            M = M + tokens["k_col"][s] @ u
        outs.append(tokens["q"][i] @ M)
    return torch.cat(outs, dim=2)


def values_and_grads(fn, t: dict[str, torch.Tensor], weight: torch.Tensor):
    t = {name: x.detach().requires_grad_() for name, x in t.items()}
    out = fn(t)
    names = list(t)
    grads = torch.autograd.grad((out * weight.to(out.dtype)).sum(), [t[name] for name in names])
    return out.detach().double(), {name: g.double() for name, g in zip(names, grads, strict=True)}


def reference(case: str):
    """The plain loop in float64: the inputs, a weight for the loss Σ out ⊙ w, the values and the gradients."""
    t = leaves(case)
    weight = torch.randn(B, H, L, DV, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return (t, weight, *values_and_grads(lambda x: plain_loop(case, x), t, weight))


@pytest.mark.parametrize("case", [*CASES, "head-keeping", "channel-delta-keeping"])
def test_effective_matrix_in_float32_equals_the_float64_loop(case):
    """A @ v (A in float32, causal) and its gradients w.r.t. every leaf, against the plain loop in float64."""
    t, weight, expected, expected_grads = reference(case)
    n = steps(case)
    single = {name: x.float() for name, x in t.items()}

    def through_the_matrix(x):
        A = effective_matrix(x["q"], x["k"], record(case, x))
        assert A.shape == (B, H, L, L * n) and A.dtype == torch.float32
        later = torch.arange(L * n).div(n, rounding_mode="floor") > torch.arange(L).unsqueeze(-1)  # (L, L·n)
        assert not A.detach()[..., later].any(), f"{case}: the effective matrix reads values of later tokens"
        return A @ x["v"]

    out, grads = values_and_grads(through_the_matrix, single, weight)
    err = (out - expected).abs().max().item() / max(1.0, expected.abs().max().item())
    assert err < VALUE_TOL, f"{case}: values off by {err:.1e} (of max(1, their largest))"
    for name, g in grads.items():
        scale = max(1.0, expected_grads[name].abs().max().item())
        err = (g - expected_grads[name]).abs().max().item() / scale
        assert err < GRAD_TOL, f"{case}: ∂{name} off by {err:.1e} (of max(1, its largest entry))"
