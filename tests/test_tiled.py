"""The tiled CPU attention kernel (:mod:`attnlab.kernels.tiled`) and the ``tiled`` backend.

* ``tiled_attention`` against a reference written out here row by row (the paper's formula for each query row:
  the logits with the bias read at the offset, the cap, the visible keys, the normaliser), in float64, outputs and
  the gradients of q, k, v, the bias table and the sink; every mask form (none, causal, sliding window, key padding,
  causal + padding, rows that see no key), every normaliser (softmax, softmax1, sink, sigmoid), grouped heads, odd
  tile sizes, both block products (PyTorch's BLAS and the kernel's own loops); float32 to rounding.
* ``tiled_differential`` (both maps in one backward pass) against ref(map 1) − λ·ref(map 2) of the same row formula,
  with the gradients of both maps' q, k and tables, v, λ and the sink, every mask form, keys shared or not.
* The ``tiled`` backend inside ``MultiHeadAttention`` against the eager path (float64), for the configurations the
  issue names: ALiBi, T5, Shaw, rope + T5, soft-capping, softmax1, sink, sigmoid, differential attention, windows.
* No (L, L) tensor: the kernel's peak memory at L 2048 is far below one (B, H, L, L) float tensor.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import attnlab
from attnlab.backends import build_backend
from attnlab.kernels import tiled
from attnlab.kernels.tiled import KeyRange, OffsetTable, tiled_attention, tiled_differential

pytestmark = [
    pytest.mark.skipif(not tiled.available(), reason="the tiled kernel cannot be built here"),
    pytest.mark.usefixtures("single_thread"),
]


def reference(q, k, v, scale, table=None, low=0, high=0, lo=None, hi=None, keys=None, cap=None, norm="softmax",
              sink=None, sigmoid_bias=None):  # fmt: skip
    """z[b, h, i] for every row, one row at a time: x_j = scale q_i·k_j + T[b, h, i][clamp(j − i) − low], capped,
    over the visible keys j ∈ [lo_i, hi_i) with keys[b, j]; softmax (+ e^{sink_h} in the denominator) or
    σ(x_j + b_i), b_i = −log(visible keys) unless given. A row with no visible key is 0."""
    B, H, Lq, _ = q.shape
    G, Lk = k.shape[1], k.shape[2]
    z = []
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            for i in range(Lq):
                visible = [
                    j for j in range(Lk) if (lo is None or lo[i] <= j < hi[i]) and (keys is None or bool(keys[b, j]))
                ]
                row = q.new_zeros(v.shape[-1])
                if visible:
                    xs = []
                    for j in visible:
                        x = scale * (q[b, h, i] * k[b, g, j]).sum()
                        if table is not None:
                            t = table
                            while t.dim() < 4:
                                t = t.unsqueeze(0)
                            t = t[b % t.shape[0], h % t.shape[1], i % t.shape[2]]
                            x = x + t[min(max(j - i, low), high) - low]
                        if cap is not None:
                            x = cap * torch.tanh(x / cap)
                        xs.append(x)
                    x = torch.stack(xs)
                    if norm == "sigmoid":
                        bias = -math.log(len(visible)) if sigmoid_bias is None else sigmoid_bias
                        w = torch.sigmoid(x + bias)
                    else:
                        m = x.max() if sink is None else torch.maximum(x.max(), sink[h])
                        e = torch.exp(x - m)
                        den = e.sum() + (0 if sink is None else torch.exp(sink[h] - m))
                        w = e / den
                    row = (w[:, None] * v[b, g, visible]).sum(0)
                z.append(row)
    return torch.stack(z).view(B, H, Lq, -1)


def _case(seed, dtype=torch.float64, Lq=None, Lk=None):
    r = random.Random(seed)
    B, G = r.randint(1, 2), r.choice([1, 2])
    H = G * r.choice([1, 2])
    Lq = Lq or r.randint(5, 23)
    Lk = Lk or Lq
    d, dv = r.randint(2, 7), r.randint(2, 6)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=dtype).requires_grad_()

    return rnd(B, H, Lq, d), rnd(B, G, Lk, d), rnd(B, G, Lk, dv), gen


def _padding(B, Lk, gen):
    keys = torch.rand(B, Lk, generator=gen) > 0.3
    keys[-1, 0] = True
    if B > 1:
        keys[0, :] = False  # sequence 0: every key padded (every row sees none)
    return keys


MASKS = ["none", "causal", "window", "causal_window", "padding", "causal+padding", "empty_rows"]


def _mask(kind, Lq, Lk, B, gen):
    i = torch.arange(Lq)
    if kind == "none":
        return {}
    if kind == "causal":
        return {"lo": torch.zeros(Lq, dtype=torch.long), "hi": (i + 1).clamp(max=Lk)}
    if kind == "window":  # |i − j| < 3
        return {"lo": (i - 2).clamp(min=0), "hi": (i + 3).clamp(max=Lk)}
    if kind == "causal_window":
        return {"lo": (i - 3).clamp(min=0), "hi": (i + 1).clamp(max=Lk)}
    if kind == "padding":
        return {"keys": _padding(B, Lk, gen)}
    if kind == "causal+padding":
        return {"lo": torch.zeros(Lq, dtype=torch.long), "hi": (i + 1).clamp(max=Lk), "keys": _padding(B, Lk, gen)}
    lo, hi = (i - 1).clamp(min=0), (i + 2).clamp(max=Lk)  # empty_rows: rows 1 and 4 see nothing
    lo[[1, 4]], hi[[1, 4]] = 0, 0
    return {"lo": lo, "hi": hi}


def _check(got, ref, inputs, atol=1e-10):
    torch.testing.assert_close(got, ref, rtol=atol, atol=atol)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(ref, inputs, g), strict=True):
        torch.testing.assert_close(a, b, rtol=atol, atol=atol)


@pytest.mark.parametrize("blas", [True, False], ids=["blas", "loops"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("bias", ["none", "offsets", "shaw"])
def test_every_mask_and_bias_equals_the_row_formula_in_float64(mask, bias, blas):
    seed = MASKS.index(mask) * 10 + ["none", "offsets", "shaw"].index(bias)
    q, k, v, gen = _case(seed)
    B, H, Lq, d = q.shape
    Lk = k.shape[2]
    m = _mask(mask, Lq, Lk, B, gen)
    inputs = [q, k, v]
    kw, rk = {}, {}
    if bias == "offsets":  # a per-head table over every offset (T5, ALiBi)
        table = torch.randn(H, Lq + Lk - 1, generator=gen, dtype=q.dtype).requires_grad_()
        kw["bias"] = OffsetTable.over_offsets(table, Lq, Lk)
        rk = {"table": table[:, None, :], "low": -(Lq - 1), "high": Lk - 1}
        inputs.append(table)
    elif bias == "shaw":  # one row per query, clipped at ±2
        table = torch.randn(B, H, Lq, 5, generator=gen, dtype=q.dtype).requires_grad_()
        kw["bias"] = OffsetTable.clipped(table, 2)
        rk = {"table": table, "low": -2, "high": 2}
        inputs.append(table)
    got = tiled_attention(q, k, v, d**-0.5, keys=KeyRange(**m), block_q=4, block_k=5, blas=blas, **kw)
    _check(got, reference(q, k, v, d**-0.5, **m, **rk), inputs)


@pytest.mark.parametrize("norm", ["softmax1", "sink", "sigmoid", "sigmoid_fixed"])
@pytest.mark.parametrize("mask", ["none", "causal+padding", "empty_rows"])
@pytest.mark.parametrize("cap", [None, 1.5])
def test_every_normalizer_with_and_without_a_cap_equals_the_row_formula(norm, mask, cap):
    q, k, v, gen = _case(hash((norm, mask, cap)) % 1000)
    B, H, Lq, d = q.shape
    m = _mask(mask, Lq, k.shape[2], B, gen)
    q2 = (q * 3).detach().requires_grad_()  # logits large enough that the cap bends them
    inputs = [q2, k, v]
    kw: dict = {"softcap": cap}
    rk: dict = {"cap": cap}
    if norm in ("softmax1", "sink"):
        sink = torch.zeros(H, dtype=q.dtype) if norm == "softmax1" else torch.randn(H, generator=gen, dtype=q.dtype)
        if norm == "sink":
            sink.requires_grad_()
            inputs.append(sink)
        kw["sink"], rk["sink"] = sink, sink
    else:
        kw["normalizer"] = rk["norm"] = "sigmoid"
        if norm == "sigmoid_fixed":
            kw["sigmoid_bias"] = rk["sigmoid_bias"] = -1.25
    got = tiled_attention(q2, k, v, d**-0.5, keys=KeyRange(**m), block_q=3, block_k=4, **kw)
    _check(got, reference(q2, k, v, d**-0.5, **m, **rk), inputs)


@pytest.mark.parametrize("blas", [True, False], ids=["blas", "loops"])
def test_float32_agrees_with_float64_to_rounding_at_a_size_with_many_tiles(blas):
    q, k, v, gen = _case(5, Lq=300, Lk=300)
    H, Lq = q.shape[1], q.shape[2]
    table = torch.randn(H, 2 * Lq - 1, generator=gen, dtype=torch.float64)
    m = _mask("causal+padding", Lq, Lq, q.shape[0], gen)
    args = {"keys": KeyRange(**m), "bias": OffsetTable.over_offsets(table, Lq, Lq), "softcap": 5.0, "blas": blas}
    z64 = tiled_attention(q, k, v, 0.5, **args)
    args["bias"] = OffsetTable.over_offsets(table.float(), Lq, Lq)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    z32 = tiled_attention(q32, k32, v32, 0.5, **args)
    torch.testing.assert_close(z32.double(), z64, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(z64)
    got, ref = torch.autograd.grad(z32, [q32, k32, v32], g.float()), torch.autograd.grad(z64, [q, k, v], g)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-3, atol=1e-4)


def test_the_block_sizes_do_not_change_the_result():
    q, k, v, gen = _case(9, Lq=37, Lk=37)
    m = KeyRange(**_mask("causal", 37, 37, q.shape[0], gen))
    outs = [tiled_attention(q, k, v, 0.3, keys=m, block_q=bq, block_k=bk) for bq, bk in [(1, 1), (7, 3), (64, 128)]]
    for z in outs[1:]:
        torch.testing.assert_close(z, outs[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize(
    "kind", ["offsets", "shaw_shared_keys", "cap_sink", "sigmoid", "loops"], ids=lambda k: k.replace("_", "-")
)
def test_the_differential_pass_equals_two_maps_of_the_row_formula_in_float64(kind, mask):
    """z = z1 − λ z2 over the same values (Ye et al. 2024, eq. 1), each map by the row formula: one backward pass
    over both maps, which shares the products with the values, against the two maps' references."""
    seed = 100 + MASKS.index(mask) * 10 + ["offsets", "shaw_shared_keys", "cap_sink", "sigmoid", "loops"].index(kind)
    q1, k1, v, gen = _case(seed)
    B, H, Lq, d = q1.shape
    Lk = k1.shape[2]
    q2 = torch.randn(q1.shape, generator=gen, dtype=q1.dtype).requires_grad_()
    shared = kind == "shaw_shared_keys"
    k2 = k1 if shared else torch.randn(k1.shape, generator=gen, dtype=k1.dtype).requires_grad_()
    lam = torch.tensor(0.6, dtype=q1.dtype, requires_grad=True)
    m = _mask(mask, Lq, Lk, B, gen)
    inputs = [q1, k1, q2, v, lam] if shared else [q1, k1, q2, k2, v, lam]
    kw: dict = {"blas": kind != "loops"}
    rk1: dict = {}
    rk2: dict = {}
    if kind in ("offsets", "loops"):
        t1, t2 = (torch.randn(H, Lq + Lk - 1, generator=gen, dtype=q1.dtype).requires_grad_() for _ in range(2))
        kw["bias1"], kw["bias2"] = OffsetTable.over_offsets(t1, Lq, Lk), OffsetTable.over_offsets(t2, Lq, Lk)
        rk1 = {"table": t1[:, None, :], "low": -(Lq - 1), "high": Lk - 1}
        rk2 = {"table": t2[:, None, :], "low": -(Lq - 1), "high": Lk - 1}
        inputs += [t1, t2]
    elif shared:  # one table for both maps: its gradient is both maps' sum
        t = torch.randn(B, H, Lq, 5, generator=gen, dtype=q1.dtype).requires_grad_()
        kw["bias1"] = kw["bias2"] = OffsetTable.clipped(t, 2)
        rk1 = rk2 = {"table": t, "low": -2, "high": 2}
        inputs.append(t)
    elif kind == "cap_sink":
        sink = torch.randn(H, generator=gen, dtype=q1.dtype).requires_grad_()
        kw.update(softcap=1.5, sink=sink)
        rk1 = rk2 = {"cap": 1.5, "sink": sink}
        inputs.append(sink)
    else:
        kw["normalizer"] = "sigmoid"
        rk1 = rk2 = {"norm": "sigmoid"}
    got = tiled_differential(q1, k1, q2, k2, v, lam, d**-0.5, keys=KeyRange(**m), block_q=4, block_k=5, **kw)
    ref = reference(q1, k1, v, d**-0.5, **m, **rk1) - lam * reference(q2, k2, v, d**-0.5, **m, **rk2)
    _check(got, ref, inputs)


def test_the_differential_pass_is_the_same_on_one_thread_and_two_and_refuses_mismatched_maps():
    q1, k1, v, gen = _case(41, dtype=torch.float32, Lq=150, Lk=150)
    q2, k2 = (torch.randn(t.shape, generator=gen).requires_grad_() for t in (q1, k1))
    lam = torch.tensor(0.3, requires_grad=True)
    keys = KeyRange(**_mask("causal+padding", 150, 150, q1.shape[0], gen))
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            z = tiled_differential(q1, k1, q2, k2, v, lam, 0.4, keys=keys, softcap=3.0)
            results.append([z, *torch.autograd.grad(z.square().sum(), [q1, k1, q2, k2, v, lam])])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="maps differ in shape"):
        tiled_differential(q1, k1, q2[:, :, :5], k2, v, lam, 0.4)
    with pytest.raises(ValueError, match="or neither does"):
        table = torch.zeros(q1.shape[1], 299)
        tiled_differential(q1, k1, q2, k2, v, lam, 0.4, bias1=OffsetTable.over_offsets(table, 150, 150))


def test_bad_inputs_get_one_line():
    q = torch.randn(1, 2, 4, 3)
    with pytest.raises(TypeError, match="float32 or float64"):
        tiled_attention(q.half(), q.half(), q.half(), 1.0)
    with pytest.raises(ValueError, match="normalizer must be softmax or sigmoid"):
        tiled_attention(q, q, q, 1.0, normalizer="sparsemax")
    with pytest.raises(ValueError, match="do not group"):
        tiled_attention(q, q[:, :1].expand(1, 3, 4, 3).contiguous(), q[:, :1].expand(1, 3, 4, 3).contiguous(), 1.0)


# ---------------------------------------------------------------------------------- the backend in a layer

LAYERS = {
    "alibi": {"position_bias": "alibi"},
    "t5": {"position_bias": "t5", "position_bias_params": {"num_buckets": 8, "max_distance": 6}},
    "shaw": {"position_bias": "shaw", "position_bias_params": {"clip": 2}},
    "rope_t5": {"position_bias": "t5", "rope": {}},
    "softcap": {"softcap": 2.0},
    "softmax1": {"normalizer": "softmax1", "position_bias": "alibi"},
    "sink": {"normalizer": "sink"},
    "sigmoid": {"normalizer": "sigmoid"},
    "diff_t5": {"differential": True, "position_bias": "t5"},
    "gqa_shaw": {"num_kv_heads": 1, "position_bias": "shaw", "position_bias_params": {"clip": 1}},
    "t5_bias_preset": {"score": "t5_bias"},
}
LAYER_MASKS = {
    "none": None,
    "causal": "causal",
    "window": {"name": "sliding_window", "window": 3},
    "causal+padding": "causal+padding",
}


def _layer_mask(kind, L):
    if kind == "causal+padding":
        keys = torch.ones(2, 1, 1, L, dtype=torch.bool)
        keys[1, ..., :2] = False  # its row 0 and 1 see no key
        return attnlab.build_mask("causal").prepare(L, L, "cpu").with_key_padding(keys)
    return None if LAYER_MASKS[kind] is None else attnlab.build_mask(LAYER_MASKS[kind])


@pytest.mark.parametrize("mask", LAYER_MASKS)
@pytest.mark.parametrize("name", LAYERS)
def test_the_backend_equals_eager_in_a_layer(name, mask):
    """Outputs and the gradients of the input and of every parameter (the bias tables, the sink), float64."""
    torch.manual_seed(3)
    mha = attnlab.MultiHeadAttention(16, 4, 4, **LAYERS[name]).double()
    with torch.no_grad():
        for p in mha.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # (a sink, a T5 table away from their initial values)
    L = 9
    x = torch.randn(2, L, 16, dtype=torch.float64, requires_grad=True)
    m = _layer_mask(mask, L)
    assert mha.backend_for("cpu", torch.float64) == "tiled"
    got, _ = build_backend("tiled").attend(mha, x, None, m)
    ref = mha.attend(x, mask=m).out
    params = [x, *mha.parameters()]
    c = torch.randn_like(ref)
    gg = torch.autograd.grad((got * c).sum(), params, allow_unused=True)
    rg = torch.autograd.grad((ref * c).sum(), params, allow_unused=True)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(gg, rg, strict=True):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_a_plain_softmax_stays_on_sdpa_unless_forced_and_a_mask_of_no_intervals_goes_on():
    plain = attnlab.MultiHeadAttention(16, 4, 4)
    assert plain.backend_for("cpu", torch.float32) == "sdpa"
    reason = build_backend("tiled").supports(plain)
    assert reason is not None and "sdpa" in reason and "\n" not in reason
    forced = attnlab.MultiHeadAttention(16, 4, 4, backend="tiled", position_bias="alibi").double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    checker = torch.zeros(6, 6, dtype=torch.bool)
    checker[:, ::2] = True  # every other key: rows that are not intervals
    got, _ = forced(x, mask=checker)
    torch.testing.assert_close(got, forced.attend(x, mask=checker).out, rtol=1e-10, atol=1e-10)


def test_no_length_by_length_tensor_is_kept_for_the_backward_pass():
    """What autograd keeps for the backward pass at L 2048 (B 1, H 2, d 16) is q, k, v, z and the log-sum-exp:
    a few hundred kB, against 32 MB for one (B, H, L, L) float tensor."""
    L = 2048
    q, k, v = (torch.randn(1, 2, L, 16, requires_grad=True) for _ in range(3))
    table = torch.randn(2, 2 * L - 1, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tiled_attention(q, k, v, 0.25, bias=OffsetTable.over_offsets(table, L, L)).sum().backward()
    assert sum(saved) < 2 * 1024 * 1024, saved


def test_the_thread_count_does_not_change_a_bit():
    """Each work item (a block of query rows forward, a key/value head backward) is computed by one thread in a
    fixed order, whatever the thread count: one and two threads give the same bits, values and gradients."""
    q, k, v, gen = _case(21, dtype=torch.float32, Lq=150, Lk=150)
    H, L = q.shape[1], q.shape[2]
    table = torch.randn(H, 2 * L - 1, generator=gen).requires_grad_()
    keys = KeyRange(**_mask("causal+padding", L, L, q.shape[0], gen))
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            z = tiled_attention(q, k, v, 0.4, bias=OffsetTable.over_offsets(table, L, L), keys=keys, softcap=3.0)
            results.append([z, *torch.autograd.grad(z.square().sum(), [q, k, v, table])])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("table_kind", ["offsets", "shaw"])
def test_the_operators_pass_torch_library_opcheck(table_kind):
    """What torch.compile and the FLOP counter see: the schema, the autograd registration, and fake kernels whose
    outputs have the real ones' shapes and strides, forward and backward (with the table's gradient)."""
    q, k, v, gen = _case(31, Lq=6, Lk=6)
    B, H, L = q.shape[0], q.shape[1], 6
    if table_kind == "offsets":
        table, low, high = torch.randn(1, H, 1, 2 * L - 1, generator=gen, dtype=q.dtype), -(L - 1), L - 1
    else:
        table, low, high = torch.randn(B, H, L, 5, generator=gen, dtype=q.dtype), -2, 2
    table.requires_grad_()
    m = _mask("causal+padding", L, L, B, gen)
    scalars = (low, high, 0.5, 2.0, False, None, 4, 4, True)
    args = (q, k, v, table, m["lo"], m["hi"], m["keys"], torch.zeros(H, dtype=q.dtype), *scalars)
    torch.library.opcheck(tiled._forward_op, args)
    z, lse = tiled._forward_op(*args)
    dz = torch.randn_like(z)
    back = (dz, q.detach(), k.detach(), v.detach(), z.detach(), lse, table.detach(), *args[4:8], *scalars, True)
    torch.library.opcheck(tiled._backward_op, back)


def test_the_differential_operators_pass_torch_library_opcheck():
    q1, k1, v, gen = _case(33, Lq=6, Lk=6)
    q2, k2 = torch.randn(q1.shape, generator=gen, dtype=q1.dtype), torch.randn(k1.shape, generator=gen, dtype=q1.dtype)
    B, H, L = q1.shape[0], q1.shape[1], 6
    t1, t2 = (torch.randn(1, H, 1, 2 * L - 1, generator=gen, dtype=q1.dtype).requires_grad_() for _ in range(2))
    lam = torch.tensor(0.4, dtype=q1.dtype, requires_grad=True)
    m = _mask("causal+padding", L, L, B, gen)
    scalars = (-(L - 1), L - 1, 0.5, 2.0, False, None, 4, 4, True)
    args = (
        q1,
        k1,
        q2.requires_grad_(),
        k2.requires_grad_(),
        v,
        lam,
        t1,
        t2,
        m["lo"],
        m["hi"],
        m["keys"],
        None,
        *scalars,
    )
    torch.library.opcheck(tiled._pair_forward_op, args)
    z, z1, z2, lse1, lse2 = tiled._pair_forward_op(*args)
    detached = tuple(t.detach() for t in (q1, k1, q2, k2, v, lam))
    back = (torch.randn_like(z), *detached, z1, z2, lse1, lse2, t1.detach(), t2.detach(), *args[8:12], *scalars, True)
    torch.library.opcheck(tiled._pair_backward_op, back)
