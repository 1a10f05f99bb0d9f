"""The compiled CPU kernels of :mod:`attnlab.kernels` and the code paths that use or replace them.

* ``additive.additive_logits`` (fused Bahdanau logits) and ``relative.relative_attention`` (softmax attention with a
  Shaw / T5 relative-position table) against references written out here with explicit loops, in float64, values
  and gradients; bitwise independence of the thread count where the kernels promise it.
* ``relative.Runs`` against a plain-Python run-length encoding.
* ``AdditiveScore``'s kernels (fused, chunked, chunked with recomputation) and its fallback when the kernel is not
  available (a ``Library`` built under ``ATTNLAB_FUSED_KERNELS=0``), with its one log line.
* ``build.build_library``: cache hits, and one-line errors.
* ``MultiHeadAttention``'s fast path through the relative kernel, and through ``BiasedSoftmaxAttention`` when the
  kernel is not available, against the eager path.

Nothing here is mocked: the spies (``SDPACalls``, the counting wrappers) call through to the real code.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging

import helpers
import pytest
import torch
from conftest import SDPACalls, additive_loop, randn, randomize_, rel_index, t5_bucket

import attnlab
import attnlab.attention
import attnlab.scores
from attnlab.backends.sdpa import BiasedSoftmaxAttention
from attnlab.kernels import additive, relative
from attnlab.kernels.build import KernelBuildError, Library, build_library
from attnlab.scores import AdditiveScore

# the kernels before the tiled one, through the automatic order without it (it takes their layers first)
pytestmark = pytest.mark.usefixtures("single_thread", "without_tiled")

TOL = 1e-12  # float64, kernel vs reference (tanh and exp are libmvec's under -ffast-math: a few ulp)
needs_additive = pytest.mark.skipif(
    not additive.available(), reason=f"no additive kernel: {additive.unavailable_reason()}"
)
needs_relative = pytest.mark.skipif(
    not relative.available(), reason=f"no relative kernel: {relative.unavailable_reason()}"
)


# ---------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def num_threads(n: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def grads_of(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 99) -> tuple[torch.Tensor, ...]:
    """∂⟨out, c⟩/∂inputs for a random upstream gradient c (the same c for the same seed and shape)."""
    c = randn(*out.shape, seed=seed).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, c)


def assert_all_close(actual, expected, tol: float = TOL) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=tol, atol=tol)


def one_line(message: str) -> bool:
    return bool(message) and "\n" not in message and "\r" not in message


def additive_reference(wq: torch.Tensor, uk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """logits[b, h, i, j] = Σ_a v[h, a] tanh(wq[b, h, i, a] + uk[b, h, j, a]), one (b, h, i, j) at a time."""
    B, H, Lq, _ = wq.shape
    Lk = uk.shape[2]
    values = []
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                for j in range(Lk):
                    values.append((v[h] * torch.tanh(wq[b, h, i] + uk[b, h, j])).sum())
    return torch.stack(values).reshape(B, H, Lq, Lk)


def additive_inputs(B, H, Lq, Lk, A, seed=0, dtype=torch.float64):
    wq = (0.8 * randn(B, H, Lq, A, seed=seed)).to(dtype).requires_grad_()
    uk = (0.8 * randn(B, H, Lk, A, seed=seed + 1)).to(dtype).requires_grad_()
    v = randn(H, A, seed=seed + 2).to(dtype).requires_grad_()
    return wq, uk, v


def shaw_index(Lq: int, Lk: int, clip: int) -> torch.Tensor:
    return rel_index(Lq, Lk, clip)


def t5_index(Lq: int, Lk: int, bidirectional: bool = True, num_buckets: int = 8, max_distance: int = 16):
    rows = [[t5_bucket(j - i, bidirectional, num_buckets, max_distance) for j in range(Lk)] for i in range(Lq)]
    return torch.tensor(rows)


def run_length_encoding(index: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """(ptr, starts, cols): for row i the runs ptr[i] .. ptr[i + 1], each a start key and its column."""
    ptr, starts, cols = [0], [], []
    for row in index.tolist():
        for j, c in enumerate(row):
            if j == 0 or c != row[j - 1]:
                starts.append(j)
                cols.append(c)
        ptr.append(len(starts))
    return ptr, starts, cols


def relative_reference(q, k, v, table, index, hidden, scale):
    """softmax(scale · q kᵀ + bias) v, bias[b, h, i, j] = table[b, h, i, index[i][j]] (a row per query: Shaw) or
    table[h, index[i][j]] (a row per head: T5), built one (i, j) at a time; hidden keys (True) get weight 0."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    rows = []
    for i in range(Lq):
        row = []
        for j in range(Lk):
            c = int(index[i][j])
            row.append(table[:, :, i, c] if table.dim() == 4 else table[:, c].expand(B, H))  # (B, H)
        rows.append(torch.stack(row, dim=-1))  # (B, H, Lk)
    bias = torch.stack(rows, dim=-2)  # (B, H, Lq, Lk)
    logits = scale * torch.einsum("bhid,bhjd->bhij", q, k) + bias
    if hidden is not None:
        logits = logits.masked_fill(hidden, float("-inf"))
    return torch.einsum("bhij,bhjd->bhid", torch.softmax(logits, dim=-1), v)


def relative_inputs(B, H, Lq, Lk, d, table_kind, seed=0):
    q = randn(B, H, Lq, d, seed=seed, requires_grad=True)
    k = randn(B, H, Lk, d, seed=seed + 1, requires_grad=True)
    v = randn(B, H, Lk, d + 1, seed=seed + 2, requires_grad=True)
    if table_kind == "shaw":
        clip = 2
        index = shaw_index(Lq, Lk, clip)
        table = randn(B, H, Lq, 2 * clip + 1, seed=seed + 3, requires_grad=True)
    else:
        index = t5_index(Lq, Lk)
        table = randn(H, 8, seed=seed + 3, requires_grad=True)
    return q, k, v, table, index


def hidden_mask(kind: str, B: int, H: int, Lq: int, Lk: int, seed: int = 7) -> torch.Tensor | None:
    """True = hidden; every row keeps at least one visible key."""
    if kind == "none":
        return None
    if kind == "key_padding":
        hidden = torch.zeros(B, 1, 1, Lk, dtype=torch.bool)
        hidden[0, ..., 0] = True
        hidden[-1, ..., Lk - 2 :] = True
        return hidden
    if kind == "causal":
        assert Lq == Lk
        return torch.tensor([[j > i for j in range(Lk)] for i in range(Lq)]).view(1, 1, Lq, Lk)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.rand(B, H, Lq, Lk, generator=gen) < 0.5
    keep = torch.randint(0, Lk, (B, H, Lq), generator=gen)
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                hidden[b, h, i, keep[b, h, i]] = False
    return hidden


def disabled_library(monkeypatch: pytest.MonkeyPatch, module) -> Library:
    """A Library for ``module``'s C file built while ATTNLAB_FUSED_KERNELS=0 (it reads the variable on first use),
    put in place of the module's own."""
    monkeypatch.setenv("ATTNLAB_FUSED_KERNELS", "0")
    lib = Library(module._LIBRARY.source, lambda _lib: None)
    assert lib.get() is None
    monkeypatch.setattr(module, "_LIBRARY", lib)
    return lib


class CallCounter:
    """A pass-through wrapper counting the calls of a real function."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- 1. additive kernel

ADDITIVE_SHAPES = {
    "lq_ne_lk": (2, 3, 4, 5, 6),
    "d_a_1": (2, 2, 3, 4, 1),
    "one_slice_fewer_rows_than_threads": (1, 1, 2, 5, 3),
    "odd_sizes_vector_tails": (2, 1, 3, 17, 33),
    "one_key": (1, 2, 5, 1, 4),
}


@needs_additive
@pytest.mark.parametrize("shape", ADDITIVE_SHAPES.values(), ids=ADDITIVE_SHAPES.keys())
def test_additive_logits_equal_the_loop_reference_values_and_gradients(shape):
    """Run with 3 threads, so that B·H = 1 has fewer (b, h) slices than threads in the backward pass."""
    wq, uk, v = additive_inputs(*shape, seed=sum(shape))
    with num_threads(3):
        out = additive.additive_logits(wq, uk, v)
        got = grads_of(out, [wq, uk, v])
    expected = additive_reference(wq, uk, v)
    assert out.dtype == torch.float64 and out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)
    assert_all_close(got, grads_of(expected, [wq, uk, v]))


@needs_additive
def test_additive_logits_take_non_contiguous_inputs():
    """wq and uk as (B, L, H, d_a) projections viewed as (B, H, L, d_a), as attention produces them."""
    B, H, Lq, Lk, A = 2, 3, 4, 6, 5
    wq_base = (0.8 * randn(B, Lq, H, A, seed=11)).requires_grad_()
    uk_base = (0.8 * randn(B, Lk, H, A, seed=12)).requires_grad_()
    v_base = randn(A, H, seed=13, requires_grad=True)
    wq, uk, v = wq_base.transpose(1, 2), uk_base.transpose(1, 2), v_base.t()
    assert not (wq.is_contiguous() or uk.is_contiguous() or v.is_contiguous())
    out = additive.additive_logits(wq, uk, v)
    expected = additive_reference(wq, uk, v)
    torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)
    inputs = [wq_base, uk_base, v_base]
    assert_all_close(grads_of(out, inputs), grads_of(expected, inputs))


@needs_additive
def test_additive_logits_gradcheck():
    wq, uk, v = additive_inputs(1, 2, 2, 3, 3, seed=21)
    assert torch.autograd.gradcheck(additive.additive_logits, (wq, uk, v), eps=1e-6, atol=1e-8, rtol=1e-6)


@needs_additive
def test_additive_operators_pass_torch_library_opcheck():
    """The operators that torch.compile sees: schema, autograd registration, and fake kernels whose output shapes and
    strides are those of the real ones, for the transposed (B, L, H, d_a) → (B, H, L, d_a) inputs attention passes
    (the backward's fake once copied the strides of uk, and compiled models fell back to eager)."""
    B, H, Lq, Lk, A = 2, 3, 4, 5, 6
    wq = randn(B, Lq, H, A, seed=31).transpose(1, 2).requires_grad_()
    uk = randn(B, Lk, H, A, seed=32).transpose(1, 2).requires_grad_()
    v = randn(H, A, seed=33, requires_grad=True)
    torch.library.opcheck(additive._forward_op, (wq, uk, v))
    grad = randn(B, H, Lq, Lk, seed=34)
    torch.library.opcheck(additive._backward_op, (grad, wq.detach(), uk.detach(), v.detach()))


# ---------------------------------------------------------------------------------------------- 2. thread counts


@needs_additive
@pytest.mark.parametrize("shape", [(2, 3, 5, 7, 9), (1, 1, 4, 17, 33)], ids=["six_slices", "one_slice"])
def test_additive_logits_are_bitwise_independent_of_the_thread_count(shape):
    wq, uk, v = additive_inputs(*shape, seed=31)
    results = []
    for n in (1, 2, 3):
        with num_threads(n):
            out = additive.additive_logits(wq, uk, v)
            results.append((out, *grads_of(out, [wq, uk, v])))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)
    torch.testing.assert_close(results[0][0], additive_reference(wq, uk, v), rtol=TOL, atol=TOL)


@needs_relative
@pytest.mark.parametrize("table_kind", ["shaw", "t5"])
def test_relative_attention_thread_count_independence(table_kind):
    """The same for 1, 2 and 3 threads up to the last bits: the kernel's rows are thread-independent, but the
    matrix products around it are PyTorch's (whose summation order may depend on the thread count on another BLAS),
    and a per-head (T5) table's gradient is summed per thread, then across threads."""
    B, H, Lq, Lk = 2, 3, 5, 9
    q, k, v, table, index = relative_inputs(B, H, Lq, Lk, 4, table_kind, seed=41)
    runs = relative.Runs(index)
    hidden = hidden_mask("key_padding", B, H, Lq, Lk)
    results = []
    for n in (1, 2, 3):
        with num_threads(n):
            z = relative.relative_attention(q, k, v, table, runs, hidden, 0.5)
            results.append((z, *grads_of(z, [q, k, v, table])))
    for other in results[1:]:
        for name, a, b in zip(("z", "dq", "dk", "dv", "dtable"), results[0], other, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-14, msg=name)


# ---------------------------------------------------------------------------------------------- 3. other dtypes


@needs_additive
def test_additive_logits_float32_close_to_the_float64_reference():
    wq, uk, v = additive_inputs(2, 2, 3, 17, 33, seed=51, dtype=torch.float32)
    out = additive.additive_logits(wq, uk, v)
    got = grads_of(out, [wq, uk, v])
    assert out.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got)
    w64, u64, v64 = (t.detach().double().requires_grad_() for t in (wq, uk, v))
    expected = additive_reference(w64, u64, v64)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert_all_close([g.double() for g in got], grads_of(expected, [w64, u64, v64]), tol=1e-4)


@needs_additive
def test_additive_logits_bfloat16_in_bfloat16_out():
    wq, uk, v = additive_inputs(1, 2, 3, 9, 8, seed=61, dtype=torch.bfloat16)
    out = additive.additive_logits(wq, uk, v)
    got = grads_of(out, [wq, uk, v])
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got)
    w64, u64, v64 = (t.detach().double().requires_grad_() for t in (wq, uk, v))  # the same (rounded) inputs
    expected = additive_reference(w64, u64, v64)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=2e-2)
    for g, e in zip(got, grads_of(expected, [w64, u64, v64]), strict=True):
        torch.testing.assert_close(g.double(), e, rtol=2e-2, atol=5e-2)


# ---------------------------------------------------------------------------------------------- 4. AdditiveScore

SCORE_VARIANTS = {
    "fused": {"kernel": "fused"},
    "auto": {"kernel": "auto"},
    "chunked": {"kernel": "chunked"},
    "chunked_2_rows_saved": {"kernel": "chunked", "chunk_size": 2},
    "chunked_2_rows_recomputed": {"kernel": "chunked", "chunk_size": 2, "save_elements": 1},
    "chunked_1_row_by_budget_recomputed": {"kernel": "chunked", "chunk_elements": 1, "save_elements": 0},
}


def score_inputs(B=2, H=2, Lq=5, Lk=4, d_k=3, seed=71):
    return randn(B, H, Lq, d_k, seed=seed, requires_grad=True), randn(B, H, Lk, d_k, seed=seed + 1, requires_grad=True)


@needs_additive
@pytest.mark.parametrize("variant", SCORE_VARIANTS.values(), ids=SCORE_VARIANTS.keys())
def test_additive_score_kernels_equal_the_reference_and_each_other(variant, monkeypatch):
    H, d_k, d_a, Lq = 2, 3, 5, 5
    reference_score = randomize_(AdditiveScore(d_k, H, d_attn=d_a, kernel="fused").double(), seed=72, scale=0.6)
    score = AdditiveScore(d_k, H, d_attn=d_a, **variant).double()
    score.load_state_dict(reference_score.state_dict())
    q, k = score_inputs(H=H, Lq=Lq, d_k=d_k)
    spy = CallCounter(additive.additive_logits)
    monkeypatch.setattr(additive, "additive_logits", spy)

    out = score(q, k)
    assert spy.calls == (0 if variant["kernel"] == "chunked" else 1)
    if variant["kernel"] == "chunked":  # the activation was kept per chunk, or not at all (recomputed)
        chunk = variant.get("chunk_size", 1 if "chunk_elements" in variant else Lq)
        kept = 0 if "save_elements" in variant else -(-Lq // chunk)
        assert len(out.grad_fn.saved_tensors) == 3 + kept
    inputs = [q, k, score.w_q, score.w_k, score.v]
    got = grads_of(out, inputs)

    expected = additive_loop(q, k, score.w_q, score.w_k, score.v)
    torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)
    assert_all_close(got, grads_of(expected, inputs))

    fused_out = reference_score(q, k)
    ref_inputs = [q, k, reference_score.w_q, reference_score.w_k, reference_score.v]
    torch.testing.assert_close(out, fused_out, rtol=TOL, atol=TOL)
    assert_all_close(got, grads_of(fused_out, ref_inputs))


# ---------------------------------------------------------------------------------------------- 5. fallback


@pytest.fixture
def additive_disabled(monkeypatch):
    lib = disabled_library(monkeypatch, additive)
    monkeypatch.setattr(attnlab.scores, "_FALLBACK_NOTED", set())
    return lib


def test_auto_falls_back_to_chunked_and_says_why_once(additive_disabled, caplog, monkeypatch):
    logger = logging.getLogger("attnlab")
    monkeypatch.setattr(logger, "propagate", True)  # a training run's RunLog may have turned it off
    caplog.set_level(logging.WARNING, logger="attnlab")
    assert not additive.available()
    reason = additive.unavailable_reason()
    assert one_line(reason) and "ATTNLAB_FUSED_KERNELS=0" in reason
    with pytest.raises(KernelBuildError, match="ATTNLAB_FUSED_KERNELS=0"):
        additive.additive_logits(*additive_inputs(1, 1, 2, 2, 2))

    score = randomize_(AdditiveScore(3, 2, d_attn=4, kernel="auto").double(), seed=81, scale=0.6)
    for seed in (82, 84):  # twice: the line is logged once
        q, k = score_inputs(seed=seed)
        out = score(q, k)
        inputs = [q, k, score.w_q, score.w_k, score.v]
        assert type(out.grad_fn).__name__ == "_AdditiveLogitsBackward"  # the chunked kernel
        expected = additive_loop(q, k, score.w_q, score.w_k, score.v)
        torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)
        assert_all_close(grads_of(out, inputs), grads_of(expected, inputs))

    # one record, counted once even when two capturing handlers saw it (a training test may leave one behind)
    records = list({id(r): r for r in caplog.records if r.name == "attnlab"}.values())
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert records[0].levelno == logging.WARNING
    assert one_line(message) and reason in message and "chunked" in message


def test_fused_kernel_unavailable_raises_a_one_line_error(additive_disabled):
    score = AdditiveScore(3, 2, kernel="fused").double()
    q, k = score_inputs(seed=91)
    with pytest.raises(RuntimeError) as info:
        score(q, k)
    message = str(info.value)
    assert one_line(message)
    assert "kernel=auto" in message and "kernel=chunked" in message and "ATTNLAB_FUSED_KERNELS=0" in message


def test_unknown_kernel_name_is_a_one_line_value_error():
    with pytest.raises(ValueError) as info:
        AdditiveScore(3, 2, kernel="triton")
    message = str(info.value)
    assert one_line(message)
    assert all(choice in message for choice in ("auto", "fused", "chunked")) and "triton" in message


# ---------------------------------------------------------------------------------------------- 6. build_library

TINY_C = "int attnlab_test_answer(int x) { return x + 41; }\n"
BROKEN_C = "int attnlab_test_broken(void) { return 1 +; }\n"


def test_build_library_without_the_compiler_names_it(tmp_path, monkeypatch):
    source = tmp_path / "tiny.c"
    source.write_text(TINY_C)
    with pytest.raises(KernelBuildError) as info:
        build_library(source, tmp_path / "cache", compiler="no-such-cc-xyz")
    assert one_line(str(info.value)) and "no-such-cc-xyz" in str(info.value)
    monkeypatch.setenv("CC", "no-such-cc-xyz-from-env")  # $CC is the default compiler
    with pytest.raises(KernelBuildError, match="no-such-cc-xyz-from-env"):
        build_library(source, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_build_library_builds_once_then_hits_the_cache(tmp_path, monkeypatch):
    source = tmp_path / "tiny.c"
    source.write_text(TINY_C)
    cache = tmp_path / "cache"
    path = build_library(source, cache)
    assert path.parent == cache and path.suffix == ".so" and path.name.startswith("tiny-")
    assert ctypes.CDLL(str(path)).attnlab_test_answer(1) == 42
    assert list(cache.iterdir()) == [path]  # the build's temporary folder is gone
    mtime = path.stat().st_mtime_ns
    assert build_library(source, cache) == path
    monkeypatch.setenv("ATTNLAB_KERNEL_CACHE", str(cache))  # the default directory
    assert build_library(source) == path
    assert path.stat().st_mtime_ns == mtime and list(cache.iterdir()) == [path]


@pytest.mark.slow
def test_build_library_syntax_error_is_a_one_line_error(tmp_path):
    source = tmp_path / "broken.c"
    source.write_text(BROKEN_C)
    with pytest.raises(KernelBuildError) as info:
        build_library(source, tmp_path / "cache")
    message = str(info.value)
    assert one_line(message) and "broken.c" in message
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # nothing half-built left behind


@pytest.mark.slow
def test_build_library_syntax_error_message_says_what_the_compiler_said(tmp_path):
    """The line kept from the compiler's output should be its diagnostic (``broken.c:1:..: error: ...``).

    Fails with gcc: build_library keeps the *last* stderr line, which for gcc ≥ 9 is the caret line under the
    quoted source (``      |        ^``), so the message reads "'cc' could not build broken.c:       |    ^"."""
    source = tmp_path / "broken.c"
    source.write_text(BROKEN_C)
    with pytest.raises(KernelBuildError) as info:
        build_library(source, tmp_path / "cache")
    message = str(info.value)
    assert "error" in message and "broken.c:1" in message, message


@pytest.mark.slow
def test_library_of_a_broken_source_is_unavailable_with_a_one_line_reason(tmp_path, monkeypatch):
    source = tmp_path / "broken.c"
    source.write_text(BROKEN_C)
    monkeypatch.setenv("ATTNLAB_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNLAB_FUSED_KERNELS", raising=False)
    lib = Library(source, lambda _lib: None)
    assert lib.get() is None
    assert one_line(lib.error) and "broken.c" in lib.error
    with pytest.raises(KernelBuildError) as info:
        lib.require()
    assert one_line(str(info.value)) and "broken" in str(info.value)


# ---------------------------------------------------------------------------------------------- 7. Runs

RUN_INDICES = {
    "shaw_square": lambda: shaw_index(6, 6, 2),
    "shaw_lq_lt_lk": lambda: shaw_index(3, 8, 2),
    "shaw_lq_gt_lk": lambda: shaw_index(7, 3, 1),
    "shaw_clip_0": lambda: shaw_index(4, 5, 0),
    "t5_square": lambda: t5_index(6, 6),
    "t5_lq_lt_lk_log_buckets": lambda: t5_index(4, 25),
    "t5_unidirectional_lq_gt_lk": lambda: t5_index(9, 5, bidirectional=False, num_buckets=6, max_distance=12),
}


@pytest.mark.parametrize("make_index", RUN_INDICES.values(), ids=RUN_INDICES.keys())
def test_runs_equal_a_plain_run_length_encoding(make_index):
    index = make_index()
    runs = relative.Runs(index)
    ptr, starts, cols = run_length_encoding(index)
    assert runs.ptr.tolist() == ptr
    assert runs.starts.tolist() == starts
    assert runs.cols.tolist() == cols
    assert runs.shape == tuple(index.shape)
    assert runs.num_columns == int(index.max()) + 1
    assert (runs.ptr.dtype, runs.starts.dtype, runs.cols.dtype) == (torch.int64, torch.int32, torch.int32)
    assert runs.starts.is_contiguous() and runs.cols.is_contiguous()
    assert relative.Runs(index).cols.tolist() == cols


# ---------------------------------------------------------------------------------------------- 8. relative kernel

RELATIVE_CASES = [
    (table, (Lq, Lk), mask)
    for table in ("shaw", "t5")
    for Lq, Lk in ((5, 5), (3, 6), (6, 4))
    for mask in ("none", "key_padding", "causal", "full")
    if mask != "causal" or Lq == Lk
]


@needs_relative
@pytest.mark.parametrize(
    ("table_kind", "sizes", "mask"), RELATIVE_CASES, ids=[f"{t}-{lq}x{lk}-{m}" for t, (lq, lk), m in RELATIVE_CASES]
)
def test_relative_attention_equals_the_textbook_formula(table_kind, sizes, mask):
    B, H = 2, 2
    Lq, Lk = sizes
    q, k, v, table, index = relative_inputs(B, H, Lq, Lk, 3, table_kind, seed=101 + Lq + 10 * Lk)
    hidden = hidden_mask(mask, B, H, Lq, Lk)
    runs = relative.Runs(index)
    scale = 0.7
    z = relative.relative_attention(q, k, v, table, runs, hidden, scale)
    expected = relative_reference(q, k, v, table, index, hidden, scale)
    torch.testing.assert_close(z, expected, rtol=TOL, atol=TOL)
    inputs = [q, k, v, table]
    assert_all_close(grads_of(z, inputs), grads_of(expected, inputs))


@needs_relative
@pytest.mark.parametrize("table_kind", ["shaw", "t5"])
def test_relative_attention_gradcheck(table_kind):
    q, k, v, table, index = relative_inputs(1, 2, 3, 4, 2, table_kind, seed=111)
    runs = relative.Runs(index)
    hidden = hidden_mask("key_padding", 1, 2, 3, 4)

    def f(q, k, v, table):
        return relative.relative_attention(q, k, v, table, runs, hidden, 0.9)

    assert torch.autograd.gradcheck(f, (q, k, v, table), eps=1e-6, atol=1e-8, rtol=1e-6)


@needs_relative
@pytest.mark.parametrize("mask", ["none", "key_padding"])
@pytest.mark.parametrize("table_kind", ["shaw", "t5"])
def test_relative_operator_passes_torch_library_opcheck(table_kind, mask):
    """As for the additive operators: the fake kernels' shapes and strides match the real ones, for transposed
    q, k, v, forward and backward."""
    B, H, L, d = 2, 2, 5, 3
    q0, k0, v0, table, index = relative_inputs(B, H, L, L, d, table_kind, seed=171)
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q0, k0, v0))
    assert not q.is_contiguous()
    runs = relative.Runs(index)
    hidden = hidden_mask(mask, B, H, L, L) if mask != "none" else None
    args = (q, k, v, table, runs.ptr, runs.starts, runs.cols, hidden, 0.5, table.dim() == 4)
    torch.library.opcheck(relative._forward_op, args)
    z, weights = relative._forward_op(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    q, k, v, table = (t.detach() for t in (q, k, v, table))
    dz = randn(*z.shape, seed=172)
    backward = (dz, q, k, v, weights, z, table, runs.ptr, runs.starts, runs.cols, 0.5, table.dim() == 4)
    torch.library.opcheck(relative._backward_op, backward)


@needs_relative
def test_relative_attention_int_mask_is_read_right_or_rejected():
    """A broadcast (B, 1, 1, Lk) mask of 0/1 ints: the same result as the bool mask, or an error, never another one.

    Fails: ``_hidden_args`` converts a non-bool mask with ``h.to(torch.uint8)``, which copies the expanded view into
    a contiguous (B, H, Lq, Lk) tensor, but passes the strides of the expanded view (0 along H and Lq), so the kernel
    reads batch b's mask at offset b·Lk of the copy (batch 0's rows) and batch 1's hidden keys are attended."""
    B, H, Lq, Lk = 2, 2, 3, 5
    q, k, v, table, index = relative_inputs(B, H, Lq, Lk, 3, "t5", seed=161)
    runs = relative.Runs(index)
    hidden = hidden_mask("key_padding", B, H, Lq, Lk)
    expected = relative_reference(q, k, v, table, index, hidden, 0.5)
    try:
        z = relative.relative_attention(q, k, v, table, runs, hidden.int(), 0.5)
    except (TypeError, ValueError):
        return
    torch.testing.assert_close(z, expected, rtol=TOL, atol=TOL)


@needs_relative
def test_relative_attention_rejects_half_precision():
    q, k, v, table, index = relative_inputs(1, 1, 2, 2, 2, "t5")
    with pytest.raises(TypeError, match="float32 or float64"):
        relative.relative_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), table, relative.Runs(index), None, 1.0)


# ---------------------------------------------------------------------------------------------- 9. MultiHeadAttention

MHA_CASES = {
    "relative_position": {"score": "relative_position", "clip": 2},
    "t5_bias": {"score": "t5_bias", "num_buckets": 8, "max_distance": 16},
    "dot_with_shaw_bias": {"score": "dot", "position_bias": "shaw", "position_bias_params": {"clip": 2}},
}
B_MHA, L_MHA, D_MODEL = 2, 5, 8


def train_mha(params: dict, seed: int = 0) -> attnlab.MultiHeadAttention:
    return helpers.make_mha(D_MODEL, 2, 4, 3, seed=seed, train=True, **params)


def mha_inputs(kind: str, seed: int = 121):
    x = randn(B_MHA, L_MHA, D_MODEL, seed=seed, requires_grad=True)
    if kind == "cross":  # Lq ≠ Lk
        return x, randn(B_MHA, L_MHA + 2, D_MODEL, seed=seed + 1, requires_grad=True), None
    return x, None, (attnlab.build_mask("causal") if kind == "causal" else None)


def assert_fast_equals_eager(mha, x, key_value, mask) -> None:
    out, weights = mha(x, key_value, mask=mask)
    assert weights is None
    eager = mha.attend(x, key_value, mask=mask).out
    torch.testing.assert_close(out, eager, rtol=1e-10, atol=1e-10)
    if torch.is_grad_enabled():
        inputs = [x, *([] if key_value is None else [key_value]), *mha.parameters()]
        assert_all_close(grads_of(out, inputs), grads_of(eager, inputs), tol=1e-10)


@needs_relative
@pytest.mark.parametrize("kind", ["self", "causal", "cross"])
@pytest.mark.parametrize("params", MHA_CASES.values(), ids=MHA_CASES.keys())
def test_mha_fast_path_takes_the_relative_kernel_and_equals_eager(params, kind):
    mha = train_mha(params)
    assert mha.uses_fast_path
    x, key_value, mask = mha_inputs(kind)
    with SDPACalls() as spy:
        mha(x, key_value, mask=mask)
    assert [call.get("kernel") for call in spy.kwargs] == ["relative"]
    assert_fast_equals_eager(mha, x, key_value, mask)


@pytest.mark.parametrize("kind", ["self", "causal", "cross"])
@pytest.mark.parametrize("params", MHA_CASES.values(), ids=MHA_CASES.keys())
def test_mha_without_the_relative_kernel_uses_biased_softmax_and_equals_eager(params, kind, monkeypatch):
    disabled_library(monkeypatch, relative)
    assert not relative.available()
    counter = CallCounter(BiasedSoftmaxAttention.apply)
    monkeypatch.setattr(BiasedSoftmaxAttention, "apply", staticmethod(counter))
    mha = train_mha(params)
    assert mha.backend_for("cpu", torch.float64) == "biased_softmax"
    x, key_value, mask = mha_inputs(kind)
    with SDPACalls() as spy:
        mha(x, key_value, mask=mask)
    assert [call.get("kernel") for call in spy.kwargs] == ["biased_softmax"]
    assert spy.kwargs[0]["attn_mask"] is not None and spy.kwargs[0]["attn_mask"].requires_grad
    assert counter.calls == 1
    assert_fast_equals_eager(mha, x, key_value, mask)


@needs_relative
@pytest.mark.parametrize("kind", ["self", "causal"])
@pytest.mark.parametrize("params", MHA_CASES.values(), ids=MHA_CASES.keys())
def test_mha_under_no_grad_uses_plain_sdpa(params, kind, monkeypatch):
    counter = CallCounter(BiasedSoftmaxAttention.apply)
    monkeypatch.setattr(BiasedSoftmaxAttention, "apply", staticmethod(counter))
    mha = train_mha(params)
    x, key_value, mask = mha_inputs(kind)
    with torch.no_grad(), SDPACalls() as spy:
        assert_fast_equals_eager(mha, x, key_value, mask)
    fast_calls = spy.kwargs  # attend() does not go through the spy: only the fast path's call is recorded
    assert [call.get("kernel") for call in fast_calls] == [None]
    assert fast_calls[0]["attn_mask"] is not None and not fast_calls[0]["attn_mask"].requires_grad
    assert counter.calls == 0


# ---------------------------------------------------------------------------------------------- 10. biased softmax


def biased_softmax_reference(q, k, v, bias, scale):
    return torch.softmax(scale * torch.einsum("bhid,bhjd->bhij", q, k) + bias, dim=-1) @ v


BIAS_SHAPES = {
    "full": (2, 3, 4, 6),
    "shared_over_batch": (1, 3, 4, 6),
    "shared_over_batch_and_heads": (1, 1, 4, 6),
    "per_batch_key": (2, 1, 1, 6),
    "two_dims": (4, 6),
}


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES.values(), ids=BIAS_SHAPES.keys())
def test_biased_softmax_attention_equals_the_textbook_formula(bias_shape):
    q = randn(2, 3, 4, 5, seed=131, requires_grad=True)
    k = randn(2, 3, 6, 5, seed=132, requires_grad=True)
    v = randn(2, 3, 6, 2, seed=133, requires_grad=True)
    bias = randn(*bias_shape, seed=134, requires_grad=True)
    z = BiasedSoftmaxAttention.apply(q, k, v, bias, 0.6)
    expected = biased_softmax_reference(q, k, v, bias, 0.6)
    torch.testing.assert_close(z, expected, rtol=TOL, atol=TOL)
    # the Function's own backward (autograd would quietly sum a gradient of the broadcast shape down to the bias's)
    raw = BiasedSoftmaxAttention.backward(z.grad_fn, randn(*z.shape, seed=99))
    assert raw[3].shape == bias.shape and raw[4] is None
    got = grads_of(z, [q, k, v, bias])
    expected_grads = grads_of(expected, [q, k, v, bias])
    assert_all_close(got, expected_grads)
    assert_all_close(raw[:4], expected_grads)


def test_biased_softmax_attention_with_hidden_keys_at_minus_inf():
    q = randn(2, 3, 4, 5, seed=141, requires_grad=True)
    k = randn(2, 3, 6, 5, seed=142, requires_grad=True)
    v = randn(2, 3, 6, 2, seed=143, requires_grad=True)
    table = randn(1, 3, 4, 6, seed=144, requires_grad=True)
    hidden = hidden_mask("full", 2, 3, 4, 6)
    bias = table.masked_fill(hidden, float("-inf"))  # (2, 3, 4, 6), as the fast path builds it
    z = BiasedSoftmaxAttention.apply(q, k, v, bias, 0.6)
    expected = relative_reference(q, k, v, table.expand(2, 3, 4, 6), torch.arange(6).expand(4, 6), hidden, 0.6)
    torch.testing.assert_close(z, expected, rtol=TOL, atol=TOL)
    inputs = [q, k, v, table]
    assert_all_close(grads_of(z, inputs), grads_of(expected, inputs))


# ---------------------------------------------------------------------------------------------- 11. CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_additive_score_on_cuda_falls_back_to_chunked_and_matches_a_cpu_reference(monkeypatch, caplog):
    monkeypatch.setattr(attnlab.scores, "_FALLBACK_NOTED", set())
    monkeypatch.setattr(logging.getLogger("attnlab"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="attnlab")
    spy = CallCounter(additive.additive_logits)
    monkeypatch.setattr(additive, "additive_logits", spy)
    score = randomize_(AdditiveScore(3, 2, d_attn=5).double(), seed=151, scale=0.6)
    q, k = score_inputs(seed=152)
    expected = additive_loop(q, k, score.w_q, score.w_k, score.v)
    expected_grads = grads_of(expected, [q, k, score.w_q, score.w_k, score.v])

    cuda_score = copy.deepcopy(score).cuda()
    qc, kc = (t.detach().cuda().requires_grad_() for t in (q, k))
    out = cuda_score(qc, kc)
    assert out.device.type == "cuda" and spy.calls == 0
    assert type(out.grad_fn).__name__ == "_AdditiveLogitsBackward"
    got = grads_of(out, [qc, kc, cuda_score.w_q, cuda_score.w_k, cuda_score.v])
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-10, atol=1e-10)
    assert_all_close([g.cpu() for g in got], expected_grads, tol=1e-10)
    records = [r.getMessage() for r in caplog.records if r.name == "attnlab"]
    assert len(records) == 1 and "cuda" in records[0]
    with pytest.raises(RuntimeError, match="kernel=chunked"):
        AdditiveScore(3, 2, kernel="fused").cuda()(qc.float(), kc.float())
