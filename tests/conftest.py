"""Shared, attnlab-independent reference implementations for the attention test suite.

Nothing here calls attnlab code: every formula is written out from the papers (Vaswani et al. 2017,
Luong et al. 2015, Bahdanau et al. 2015, Shaw et al. 2018, Raffel et al. 2020 / Mesh TensorFlow,
Press et al. 2022) so that the tests compare the package against an independent reference. (The one exception,
:class:`SDPACalls`, is a spy on the package's attention call, not a reference.)
The helpers are exposed through the ``ref`` fixture. Plain helpers shared by the test files are in helpers.py,
imported here first (its lists of built-in names are then read before any test registers a name of its own).
"""

import math
import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from helpers import randomize_

import attnlab.attention
import attnlab.kernels.relative


# ---------------------------------------------------------------- utilities
def randn(*shape, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return t.requires_grad_(requires_grad)


def grads(out, inputs, seed=123):
    """Gradients of <out, c> w.r.t. ``inputs`` for a fixed random cotangent c (None entries -> zeros)."""
    c = randn(*out.shape, seed=seed).to(out.dtype)
    gs = torch.autograd.grad(out, inputs, grad_outputs=c, allow_unused=True, retain_graph=True)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(gs, inputs, strict=True)]


def assert_same(a, b, inputs, atol=1e-10):
    """Equal values, and equal gradients (for one fixed random cotangent) w.r.t. every input."""
    torch.testing.assert_close(a, b, rtol=atol, atol=atol)
    for ga, gb in zip(grads(a, inputs), grads(b, inputs), strict=True):
        torch.testing.assert_close(ga, gb, rtol=atol, atol=atol)


class SDPACalls:
    """Records the keyword arguments of every call of the fast path's attention: SDPA
    (:func:`attnlab.backends.sdpa.scaled_dot_product_attention`),
    or the fused relative-position kernel, recorded as ``{"kernel": "relative", "attn_mask": table,
    "is_causal": False}``, or the ``biased_softmax`` backend's call (SDPA's equivalent for a learned bias on the
    CPU), recorded as ``{"kernel": "biased_softmax", "attn_mask": bias, "is_causal": False}``; use as a context
    manager."""

    def __init__(self):
        self.kwargs = []

    def __enter__(self):
        sdpa = attnlab.backends.sdpa.scaled_dot_product_attention
        relative = attnlab.kernels.relative.relative_attention
        biased = attnlab.backends.sdpa.BiasedSoftmaxAttention.apply

        def spy_sdpa(*args, **kwargs):
            self.kwargs.append(dict(kwargs))
            return sdpa(*args, **kwargs)

        def spy_relative(q, k, v, table, runs, hidden, scale):
            self.kwargs.append({"kernel": "relative", "attn_mask": table, "is_causal": False, "scale": scale})
            return relative(q, k, v, table, runs, hidden, scale)

        def spy_biased(q, k, v, bias, scale):
            self.kwargs.append({"kernel": "biased_softmax", "attn_mask": bias, "is_causal": False, "scale": scale})
            return biased(q, k, v, bias, scale)

        self._patches = [
            mock.patch.object(attnlab.backends.sdpa, "scaled_dot_product_attention", spy_sdpa),
            mock.patch.object(attnlab.kernels.relative, "relative_attention", spy_relative),
            mock.patch.object(attnlab.backends.sdpa.BiasedSoftmaxAttention, "apply", staticmethod(spy_biased)),
        ]
        for p in self._patches:
            p.__enter__()
        return self

    def __exit__(self, *exc):
        for p in reversed(self._patches):
            p.__exit__(*exc)
        return False


# ---------------------------------------------------------------- relative positions
def rel_index(Lq, Lk, clip):
    """Shaw et al. table index clamp(j - i, -clip, clip) + clip built with plain Python loops."""
    return torch.tensor([[min(max(j - i, -clip), clip) + clip for j in range(Lk)] for i in range(Lq)])


def t5_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128):
    """Plain-Python T5 / Mesh TensorFlow relative-position bucket for one relative position (key - query)."""
    n = -rel
    ret = 0
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return ret + min(val, num_buckets - 1)


def alibi_slopes(n):
    """Press et al. (2022) reference slopes, including the interleaving for non-powers of two."""

    def power_of_two(m):
        start = 2.0 ** (-(2.0 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][: n - closest]


# ---------------------------------------------------------------- score references
def qk(q, k):
    return torch.einsum("bhid,bhjd->bhij", q, k)


def additive_loop(q, k, w_q, w_k, v):
    """Bahdanau score with explicit loops over (b, h, i, j)."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    vals = []
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                qa = q[b, h, i] @ w_q[h]
                for j in range(Lk):
                    vals.append((v[h] * torch.tanh(qa + k[b, h, j] @ w_k[h])).sum())
    return torch.stack(vals).reshape(B, H, Lq, Lk)


def additive_naive_5d(q, k, w_q, w_k, v):
    """The 'naive 5-D' Bahdanau form: tanh over a (B, H, Lq, Lk, d_a) tensor, then contract with v."""
    qa = torch.einsum("bhid,hda->bhia", q, w_q)
    ka = torch.einsum("bhjd,hda->bhja", k, w_k)
    return torch.einsum("bhija,ha->bhij", torch.tanh(qa[:, :, :, None, :] + ka[:, :, None, :, :]), v)


def score_logits(name, params, score, q, k, bias=None):
    """Reference logits for built-in score or preset ``name`` built with ``params``, using the module's parameters:
    ``score``'s own (general, additive) and, for a preset, its position bias's (``rel_k``, ``rel_bias``): ``bias``,
    by default ``score.position_bias`` (what ``build_score`` gives for a preset)."""
    d_k = q.shape[-1]
    if bias is None and name in ("relative_position", "t5_bias"):
        bias = score.position_bias
    Lq, Lk = q.shape[2], k.shape[2]
    if name == "dot":
        return qk(q, k)
    if name == "scaled_dot":
        return qk(q, k) / math.sqrt(d_k)
    if name == "general":
        return torch.einsum("bhid,hde,bhje->bhij", q, score.weight, k)
    if name == "additive":
        return additive_loop(q, k, score.w_q, score.w_k, score.v)
    if name == "relative_position":
        clip = params.get("clip", 16)
        rel = bias.rel_k[rel_index(Lq, Lk, clip)]  # (Lq, Lk, d_k)
        return (qk(q, k) + torch.einsum("bhid,ijd->bhij", q, rel)) / math.sqrt(d_k)
    if name == "t5_bias":
        nb = params.get("num_buckets", 32)
        md = params.get("max_distance", 128)
        bidir = params.get("bidirectional", True)
        scale = 1 / math.sqrt(d_k) if params.get("scale", False) else 1.0
        buckets = torch.tensor([[t5_bucket(j - i, bidir, nb, md) for j in range(Lk)] for i in range(Lq)])
        table = bias.rel_bias[buckets].permute(2, 0, 1)  # (H, Lq, Lk)
        return qk(q, k) * scale + table[None]
    if name == "alibi":
        H = q.shape[1]
        slopes = torch.tensor(alibi_slopes(H), dtype=q.dtype)
        dist = torch.tensor([[abs(j - i) for j in range(Lk)] for i in range(Lq)], dtype=q.dtype)
        return qk(q, k) / math.sqrt(d_k) - slopes[:, None, None] * dist
    if name == "cosine":  # Swin v2: tau_h * q.k / (|q| |k|), tau_h = exp(min(log_scale_h, log max_scale))
        cap = torch.tensor(math.log(params.get("max_scale", 100.0)), dtype=q.dtype)
        tau = torch.exp(torch.minimum(score.log_scale, cap))
        norms = torch.sqrt((q * q).sum(-1))[..., :, None] * torch.sqrt((k * k).sum(-1))[..., None, :]
        return tau[None, :, None, None] * qk(q, k) / norms
    if name == "linear":  # Katharopoulos et al. 2020: phi(q_i) . phi(k_j), phi(x) = elu(x) + 1 by default
        phi = LINEAR_FEATURE_MAPS[params.get("feature_map", "elu")]
        return torch.einsum("bhif,bhjf->bhij", phi(q), phi(k))
    raise AssertionError(f"no reference for {name}")


def elu_plus_one(x):
    """elu(x) + 1, written out: x + 1 for x > 0, e^x otherwise (Katharopoulos et al. 2020, eq. 7)."""
    return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))


def relu_features(x):
    """max(x, 0), coordinate-wise."""
    return torch.where(x > 0, x, torch.zeros_like(x))


# the parameter-free feature maps of the linear score, written out (the others are checked in test_linear_attention)
LINEAR_FEATURE_MAPS = {"elu": elu_plus_one, "relu": relu_features}


def shaw_value_term(weights, rel_v, clip):
    """sum_j weights[b,h,i,j] * rel_v[clamp(j-i,-clip,clip)+clip] with explicit loops over i, j."""
    Lq, Lk = weights.shape[-2:]
    idx = rel_index(Lq, Lk, clip)
    rows = []
    for i in range(Lq):
        acc = 0
        for j in range(Lk):
            acc = acc + weights[:, :, i, j, None] * rel_v[idx[i, j]]
        rows.append(acc)
    return torch.stack(rows, dim=2)


# ---------------------------------------------------------------- attention reference
def masked_softmax(logits, mask):
    """Softmax over keys restricted to ``mask`` (True = visible); rows with no visible key are all zero."""
    if mask is None:
        mask = torch.ones_like(logits, dtype=torch.bool)
    mask = mask.expand_as(logits)
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype)
    mx = torch.where(mask, logits, neg_inf).amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)).detach()
    e = torch.exp(logits - mx) * mask
    denom = e.sum(-1, keepdim=True)
    return torch.where(denom > 0, e / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(e))


def linear(layer, x):
    y = x @ layer.weight.T
    return y if layer.bias is None else y + layer.bias


def split_heads(t, H):
    B, L, _ = t.shape
    return t.reshape(B, L, H, -1).transpose(1, 2)


def mha_reference(mha, x, H, logits_fn, key_value=None, mask=None, value_fn=None):
    """Eager multi-head attention written from the formula.

    ``logits_fn(q, k)`` gives the raw logits from projected (B,H,L,d_k) q/k, ``value_fn(weights)`` an optional
    per-head value-side term added to weights @ v. Returns (out, weights, logits).
    """
    kv = x if key_value is None else key_value
    q = split_heads(linear(mha.q_proj, x), H)
    k = split_heads(linear(mha.k_proj, kv), H)
    v = split_heads(linear(mha.v_proj, kv), H)
    logits = logits_fn(q, k)
    w = masked_softmax(logits, mask)
    heads = w @ v
    if value_fn is not None:
        heads = heads + value_fn(w)
    B, _, Lq, _ = heads.shape
    out = linear(mha.out_proj, heads.transpose(1, 2).reshape(B, Lq, -1))
    return out, w, logits


def project_qk(mha, x, H, key_value=None):
    kv = x if key_value is None else key_value
    return split_heads(linear(mha.q_proj, x), H), split_heads(linear(mha.k_proj, kv), H)


def pytest_configure(config):
    """A pytest-xdist worker (``make test`` starts one per core) runs torch on one thread, and so do the runs it
    trains in process with ``threads=auto`` (which reads ``OMP_NUM_THREADS``): two threads per worker on top of one
    worker per core only wait for each other (a test that needs more threads sets them itself)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture
def without_tiled():
    """The automatic backend order without ``tiled`` (the tiled kernel takes every biased softmax first): for the
    tests of the backends it now comes before (sdpa's fast path, relative, biased_softmax, normalized)."""
    from attnlab.backends import ORDER

    at = ORDER.index("tiled")
    ORDER.remove("tiled")
    yield
    ORDER.insert(at, "tiled")


@pytest.fixture
def single_thread():
    """The attention tests use tiny tensors: intra-op threads only add overhead (and stall badly on a busy
    2-core machine), so these modules run single-threaded and restore the setting afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def ref():
    return SimpleNamespace(
        randomize_=randomize_,
        randn=randn,
        grads=grads,
        rel_index=rel_index,
        t5_bucket=t5_bucket,
        alibi_slopes=alibi_slopes,
        qk=qk,
        additive_loop=additive_loop,
        additive_naive_5d=additive_naive_5d,
        score_logits=score_logits,
        shaw_value_term=shaw_value_term,
        masked_softmax=masked_softmax,
        linear=linear,
        split_heads=split_heads,
        mha_reference=mha_reference,
        project_qk=project_qk,
    )


# ---------------------------------------------------------------------------------------------- training tests


@pytest.fixture(scope="module")
def hydra_ctx():
    """Hydra's compose API pointed at the repository's conf/ for the whole module."""
    from hydra import initialize_config_dir

    from attnlab.training import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


@pytest.fixture
def restore_process_state():
    """Tiny models run faster on one thread (and the machine is shared); ``run`` sets torch's threads and may
    draw a launch id into os.environ: put both back afterwards."""
    import os

    threads, uid = torch.get_num_threads(), os.environ.get("ATTNLAB_UID")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if uid is None:
        os.environ.pop("ATTNLAB_UID", None)
    else:
        os.environ["ATTNLAB_UID"] = uid


@pytest.fixture
def snapshot():
    """``snapshot(folder)``: every file under ``folder`` with its bytes, to show that a command changed nothing."""

    def take(folder):
        return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}

    return take
