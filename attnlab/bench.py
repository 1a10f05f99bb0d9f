"""Benchmark harness: attnlab against PyTorch's own attention, measured side by side in one process.

    python -m attnlab.bench                   # the full benchmark (minutes; run it on an otherwise idle machine)
    python -m attnlab.bench --quick           # a tiny smoke run (seconds)
    python -m attnlab.bench --device cuda --dtype bf16

Sections (each a function below; ``--only`` picks some):

* ``encoder``: one training step (forward + backward + AdamW step) of a 2-layer encoder + linear head with a
  per-token cross-entropy loss, for every attention variant and for ``torch.nn.TransformerEncoder`` at identical
  shapes (pre-LN, GELU, d_ff = 4·d_model, no dropout, same embedding, sinusoidal encoding and final norm), over
  L ∈ {128, 512, 1024} at 4096 tokens per batch, and several (heads, d_k). Warm-up, then interleaved
  repetitions (A B C … A B C …), medians; then one profiled step per model for the peak memory (allocations above
  the resting parameters and optimizer state) and the SDPA kernel that ran.
* ``mha``: the attention module alone, attnlab ``MultiHeadAttention`` against ``nn.MultiheadAttention``.
* ``variants``: the same encoder training step (same shapes: 4096 tokens per batch, d_model 128, 2 layers, H = 4,
  d_k = 32) with each attention stage of :data:`ATTENTION_VARIANTS` switched on in turn (rotary positions, QK-norm,
  grouped/multi-query heads, cosine score, differential attention, soft-capping, ALiBi as a position bias, every
  eager normalizer), against attnlab's plain ``scaled_dot`` timed in the same interleaved rounds, at
  L ∈ {128, 512, 1024}; each marked with whether it takes the SDPA fast path
  (``MultiHeadAttention.uses_fast_path``).
* ``diagnostics``: real Lightning training of the default config (``attnlab.train.run``, logger none) with the
  attention diagnostics callback on and off, interleaved, whole-run wall times.
* ``additive_memory``: peak memory of the additive score's forward + backward against the naive form that
  materialises (B, H, L, L, d_a), each in a fresh subprocess (peak RSS: VmHWM reset before the measurement, or
  ``ru_maxrss``), and the largest difference between their results.
* ``default_run``: wall time of the default ``python train.py`` (a subprocess; skipped with ``--quick``).
* ``fused``: SDPA restricted to the fused kernels (flash, memory-efficient) must accept ``scaled_dot``.

Writes ``bench.json`` (everything, with the machine: platform, CPU model, cores, torch version, threads, date),
``bench.csv`` (one row per measured model) and ``targets.csv`` (each target's ratio, limit, met) into ``--out``
(default: a new folder ``bench_results/<date-time>/``, with ``bench_results/latest`` pointing at it), and prints
the tables. Targets are checked here, never by a timed test; a ``--quick`` run is labelled as such and never
judged against them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.attention import MultiHeadAttention
from attnlab.encoder import Encoder, SinusoidalPositionalEncoding
from attnlab.runs import load_run
from attnlab.scores import AdditiveScore

__all__ = [
    "ATTENTION_VARIANTS",
    "VARIANTS",
    "VARIANT_GOALS",
    "FusedKernelUnavailable",
    "Group",
    "ModelSpec",
    "Shape",
    "TorchEncoder",
    "bench_variants",
    "build_model",
    "check_fused_sdpa",
    "interleaved_times",
    "machine_info",
    "main",
    "naive_additive_logits",
    "run_bench",
]

VARIANTS: tuple[str, ...] = ("scaled_dot", "dot", "general", "relative_position", "t5_bias", "alibi", "additive")
VOCAB_SIZE = 64
NUM_CLASSES = 16
REPO_ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("fused", "encoder", "mha", "variants", "diagnostics", "additive_memory", "default_run")

# The ``variants`` section: name → the Encoder options that differ from the reference ``scaled_dot`` (score
# scaled_dot, sinusoidal positions, softmax, H key/value heads). Rotary positions replace the sinusoidal table.
ATTENTION_VARIANTS: dict[str, dict[str, Any]] = {
    "scaled_dot": {},
    "rope": {"pos_encoding": "rope"},
    "rope_half": {"pos_encoding": "rope", "rope": {"fraction": 0.5}},
    "qk_rmsnorm": {"qk_norm": "rmsnorm"},
    "qk_layernorm": {"qk_norm": "layernorm"},
    "gqa2": {"num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1},
    "cosine": {"score": "cosine"},
    "diff": {"differential": True},
    "softcap50": {"softcap": 50.0},
    "alibi_bias": {"position_bias": "alibi"},
    "softmax1": {"normalizer": "softmax1"},
    "sink": {"normalizer": "sink"},
    "sigmoid": {"normalizer": "sigmoid"},
    "sparsemax": {"normalizer": "sparsemax"},
    "entmax15": {"normalizer": "entmax15"},
    "softpick": {"normalizer": "softpick"},
}
# The variants' goals, judged at the plan's ``target_variant_length``: (target id, variants, limit on step ÷
# scaled_dot). Rotary, QK-norm and grouped heads must cost (almost) nothing; an eager normalizer at most 2.5×.
VARIANT_GOALS: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("7", ("rope", "rope_half", "qk_rmsnorm", "qk_layernorm", "gqa2", "mqa"), 1.10),
    ("8", ("softmax1", "sink", "sigmoid", "sparsemax", "entmax15", "softpick"), 2.5),
)


class FusedKernelUnavailable(RuntimeError):
    """SDPA could not dispatch an attention call to a fused kernel (flash or memory-efficient)."""


# ============================================================================================ shapes and models


@dataclass(frozen=True)
class Shape:
    """Sizes of one benchmarked encoder: batch B, length L, width, heads H, per-head key size d_k, layers."""

    batch: int
    length: int
    d_model: int
    num_heads: int
    d_k: int
    num_layers: int = 2

    @property
    def tokens(self) -> int:
        return self.batch * self.length

    def tag(self) -> str:
        return f"B{self.batch} L{self.length} d{self.d_model} H{self.num_heads} dk{self.d_k}"


@dataclass(frozen=True)
class ModelSpec:
    """One model of a timing group: ``impl`` is ``torch`` (the reference) or ``attnlab`` with a ``score``, and
    optionally the name of one of :data:`ATTENTION_VARIANTS` (then ``score`` is that variant's score)."""

    impl: str
    score: str
    shape: Shape
    variant: str = ""

    @classmethod
    def of_variant(cls, variant: str, shape: Shape) -> ModelSpec:
        """The attnlab encoder of the ``variants`` section named ``variant``."""
        return cls("attnlab", ATTENTION_VARIANTS[variant].get("score", "scaled_dot"), shape, variant)

    @property
    def label(self) -> str:
        name = "torch" if self.impl == "torch" else self.variant or self.score
        return f"{name} {self.shape.tag()}"


class TorchEncoder(nn.Module):
    """The network of ``attnlab.Encoder(score="scaled_dot")`` built from ``torch.nn.TransformerEncoder``.

    Embedding + sinusoidal encoding, ``num_layers`` × ``TransformerEncoderLayer(d_model, nhead, 4·d_model,
    dropout=0, gelu, batch_first, norm_first)``, final LayerNorm: tokens (B, L) → (B, L, d_model).
    """

    def __init__(self, vocab_size: int, d_model: int, num_heads: int, num_layers: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = SinusoidalPositionalEncoding(d_model, max_len)
        layer = nn.TransformerEncoderLayer(
            d_model,
            num_heads,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.layers = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (B, L) → (B, L, d_model)."""
        h = self.embed(tokens) + self.pos(tokens.shape[1])
        return self.norm(self.layers(h))


class _Tagger(nn.Module):
    """encoder + linear head: tokens (B, L) → per-token logits (B, L, NUM_CLASSES)."""

    def __init__(self, encoder: nn.Module, d_model: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(d_model, NUM_CLASSES)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(tokens))


def build_model(spec: ModelSpec, seed: int = 0) -> nn.Module:
    """The benchmarked network for ``spec``: tokens (B, L) → logits (B, L, NUM_CLASSES)."""
    torch.manual_seed(seed)
    s = spec.shape
    if spec.impl == "torch":
        if s.num_heads * s.d_k != s.d_model:
            raise ValueError(f"torch's encoder needs d_k = d_model / num_heads, got {s.tag()}")
        encoder: nn.Module = TorchEncoder(VOCAB_SIZE, s.d_model, s.num_heads, s.num_layers, s.length)
    else:
        options = {k: v for k, v in ATTENTION_VARIANTS[spec.variant].items() if k != "score"} if spec.variant else {}
        options.setdefault("pos_encoding", "sinusoidal")
        encoder = Encoder(
            VOCAB_SIZE, s.d_model, s.num_heads, s.num_layers, d_k=s.d_k, score=spec.score, max_len=s.length, **options
        )
    return _Tagger(encoder, s.d_model)


def _fast_path(model: nn.Module) -> bool | None:
    """Whether every attnlab attention of ``model`` dispatches to SDPA (None: it has none)."""
    flags = [m.uses_fast_path for m in model.modules() if isinstance(m, MultiHeadAttention)]
    return all(flags) if flags else None


# ============================================================================================ measurement


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_train_step(
    model: nn.Module, batch: int, length: int, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> Callable[[], None]:
    """A closure running one training step: zero_grad, forward (autocast to ``dtype`` unless float32),
    cross-entropy over (B·L) tokens, backward, AdamW step. Inputs are fixed random tokens (B, L)."""
    model.to(device).train()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB_SIZE, (batch, length), generator=gen).to(device)
    labels = torch.randint(0, NUM_CLASSES, (batch * length,), generator=gen).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, NUM_CLASSES).float(), labels)
        loss.backward()
        opt.step()

    return step


def interleaved_times(
    steps: dict[str, Callable[[], None]], warmup: int, reps: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds per call of each closure: ``warmup`` untimed calls each, then ``reps`` rounds calling every
    closure once in turn (A B C … A B C …), timed with ``time.perf_counter`` (device synchronised)."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
        _sync(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, fn in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the C++ profiler's start/stop lines on fd 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_KERNELS = (
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_scaled_dot_product_efficient_attention", "efficient"),
    ("_scaled_dot_product_cudnn_attention", "cudnn"),
    ("_scaled_dot_product_attention_math", "math"),
)


def _kernel_names(names: set[str]) -> str:
    found = [short for needle, short in _KERNELS if any(needle in n and "backward" not in n for n in names)]
    return "+".join(found) if found else "eager"


def profile_step(step: Callable[[], None], device: torch.device) -> tuple[float, str]:
    """Run ``step`` once → (peak MB allocated above the memory held before it, SDPA kernel(s) that ran:
    ``flash``, ``efficient``, ``cudnn``, ``math``, or ``eager`` when SDPA was not called).

    On CUDA the peak is ``torch.cuda.max_memory_allocated``; on CPU it is the running sum of the profiler's
    allocation and free events (torch tensors only)."""
    from torch.profiler import ProfilerActivity, profile

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=device.type == "cpu") as prof:
        step()
        _sync(device)
    names = {e.name for e in prof.events()}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - start
    else:
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        )
        running = peak = 0
        for _, nbytes in events:
            running += nbytes
            peak = max(peak, running)
    return peak / 2**20, _kernel_names(names)


def _summary(times: Sequence[float]) -> dict[str, float]:
    ts = sorted(times)
    return {
        "median_ms": 1e3 * statistics.median(ts),
        "min_ms": 1e3 * ts[0],
        "max_ms": 1e3 * ts[-1],
    }


# ============================================================================================ sections


@dataclass(frozen=True)
class Group:
    """Models timed together, interleaved, for ``reps_factor`` × the plan's repetitions."""

    name: str
    specs: tuple[ModelSpec, ...]
    reps_factor: int = 1


@dataclass
class Plan:
    """What to measure. ``groups``: lists of models timed together (interleaved). Every row gets ``ratio_torch``
    against the torch model of its shape and ``ratio_scaled_dot`` against attnlab's scaled_dot of its
    (B, L, d_model, H) with d_k = d_model / H. ``variant_shapes``: one shape per length for the ``variants``
    section, timed ``variant_reps`` rounds (None: ``reps``), then profiled unless ``variant_profile`` is False.
    ``target_*``: the shapes and lengths the targets read."""

    quick: bool
    warmup: int
    reps: int
    groups: list[Group]
    mha_shapes: list[Shape]
    diag_overrides: list[str]
    diag_pairs: int
    memory_shape: Shape  # additive memory: batch, length, heads, d_k (= d_attn); d_model unused
    target_short: Shape
    target_long_length: int
    target_additive_length: int
    variant_shapes: list[Shape] = field(default_factory=list)
    variant_reps: int | None = None
    variant_profile: bool = True  # one profiled step per variant (peak MB, SDPA kernel): ~0.25 s each on a CPU
    target_variant_length: int = 512


def full_plan(warmup: int = 2, reps: int = 7) -> Plan:
    """L ∈ {128, 512, 1024} at 4096 tokens per batch, d_model 128, 2 layers; (H, d_k) ∈ {(4, 32), (8, 16),
    (2, 64)} against torch; every variant at (4, 32); d_k ∈ {16, 64, 128} (≠ d_model / H) at L = 512. The
    ``variants`` section: every one of :data:`ATTENTION_VARIANTS` at (4, 32) for each L (GQA: 2 key/value heads
    for 4 query heads, MQA: 1)."""
    target = Shape(32, 128, 128, 4, 32)
    groups = [Group("torch_ab", (ModelSpec("torch", "", target), ModelSpec("attnlab", "scaled_dot", target)), 3)]
    for length, batch in ((128, 32), (512, 8), (1024, 4)):
        base = Shape(batch, length, 128, 4, 32)
        group = [ModelSpec("torch", "", base)] + [ModelSpec("attnlab", v, base) for v in VARIANTS]
        for heads, d_k in ((8, 16), (2, 64)):
            s = Shape(batch, length, 128, heads, d_k)
            group += [ModelSpec("torch", "", s), ModelSpec("attnlab", "scaled_dot", s)]
        if length == 512:
            group += [ModelSpec("attnlab", "scaled_dot", Shape(batch, length, 128, 4, d)) for d in (16, 64, 128)]
        groups.append(Group(f"L{length}", tuple(group)))
    return Plan(
        quick=False,
        warmup=warmup,
        reps=reps,
        groups=groups,
        mha_shapes=[Shape(b, n, 128, 4, 32) for n, b in ((128, 32), (512, 8), (1024, 4))],
        diag_overrides=[],
        diag_pairs=3,
        memory_shape=Shape(1, 1024, 128, 4, 32),
        target_short=target,
        target_long_length=512,
        target_additive_length=1024,
        variant_shapes=[Shape(b, n, 128, 4, 32) for n, b in ((128, 32), (512, 8), (1024, 4))],
        target_variant_length=512,
    )


def quick_plan() -> Plan:
    """Tiny shapes, one warm-up, three repetitions (one for the variants): checks that every section runs, in
    seconds."""
    short, long = Shape(4, 16, 32, 2, 16), Shape(2, 32, 32, 2, 16)
    groups = [
        Group("torch_ab", (ModelSpec("torch", "", short), ModelSpec("attnlab", "scaled_dot", short)), 2),
        Group(f"L{long.length}", (ModelSpec("torch", "", long), *(ModelSpec("attnlab", v, long) for v in VARIANTS))),
    ]
    return Plan(
        quick=True,
        warmup=1,
        reps=3,
        groups=groups,
        mha_shapes=[short],
        diag_overrides=["debug=fast", "diagnostics.every_n_steps=2", "trainer.limit_val_batches=1"],
        diag_pairs=1,
        memory_shape=Shape(1, 256, 32, 2, 16),
        target_short=short,
        target_long_length=32,
        target_additive_length=32,
        variant_shapes=[Shape(2, 16, 32, 4, 8), Shape(1, 32, 32, 4, 8)],
        variant_reps=1,
        variant_profile=False,
        target_variant_length=32,
    )


def bench_encoder(plan: Plan, device: torch.device, dtype: torch.dtype, log: Callable[[str], None]) -> list[dict]:
    """Time every group of ``plan`` → one row per model (median step, tokens/s, peak MB, SDPA kernel, ratios)."""
    rows: list[dict] = []
    for group in plan.groups:
        steps = {}
        for spec in group.specs:
            model = build_model(spec)
            steps[spec.label] = make_train_step(model, spec.shape.batch, spec.shape.length, device, dtype)
        log(f"encoder: group {group.name}, {len(group.specs)} models ...")
        times = interleaved_times(steps, plan.warmup, plan.reps * group.reps_factor, device)
        group_rows = []
        for spec in group.specs:
            peak_mb, kernel = profile_step(steps[spec.label], device)
            stats = _summary(times[spec.label])
            group_rows.append(
                {
                    "section": "encoder",
                    "group": group.name,
                    "label": spec.label,
                    "impl": spec.impl,
                    "score": spec.score or "torch",
                    **asdict(spec.shape),
                    **stats,
                    "reps": len(times[spec.label]),
                    "tokens_per_s": spec.shape.tokens / (stats["median_ms"] / 1e3),
                    "peak_mb": peak_mb,
                    "sdpa_kernel": kernel,
                }
            )
        _add_ratios(group_rows)
        rows += group_rows
        del steps
    return rows


def _same_size(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in ("batch", "length", "d_model", "num_heads", "num_layers"))


def _add_ratios(rows: list[dict]) -> None:
    """ratio_torch: median step ÷ torch's at the same shape; ratio_scaled_dot: ÷ attnlab scaled_dot's at the same
    (B, L, d_model, H) with d_k = d_model / H."""
    for row in rows:
        row["ratio_torch"] = row["ratio_scaled_dot"] = None
        for other in rows:
            if not _same_size(row, other):
                continue
            if other["impl"] == "torch" and other["d_k"] == row["d_k"]:
                row["ratio_torch"] = row["median_ms"] / other["median_ms"]
            if other["score"] == "scaled_dot" and other["d_k"] * other["num_heads"] == other["d_model"]:
                row["ratio_scaled_dot"] = row["median_ms"] / other["median_ms"]


def bench_variants(plan: Plan, device: torch.device, dtype: torch.dtype, log: Callable[[str], None]) -> list[dict]:
    """The encoder training step of every one of :data:`ATTENTION_VARIANTS`, at each of ``plan.variant_shapes``:
    all variants of a length timed together, interleaved, then one profiled step each (peak MB, SDPA kernel;
    unless ``plan.variant_profile`` is False) → one row per model, with ``ratio_scaled_dot`` (median step ÷ the
    ``scaled_dot`` variant's at that length) and ``fast_path`` (whether its attention dispatches to SDPA)."""
    reps = plan.variant_reps if plan.variant_reps is not None else plan.reps
    rows: list[dict] = []
    for shape in plan.variant_shapes:
        specs = [ModelSpec.of_variant(name, shape) for name in ATTENTION_VARIANTS]
        steps, fast = {}, {}
        for spec in specs:
            model = build_model(spec)
            fast[spec.variant] = _fast_path(model)
            steps[spec.variant] = make_train_step(model, shape.batch, shape.length, device, dtype)
        log(f"variants: {shape.tag()}, {len(specs)} models ...")
        times = interleaved_times(steps, plan.warmup, reps, device)
        ref = statistics.median(times["scaled_dot"])
        for spec in specs:
            peak_mb, kernel = profile_step(steps[spec.variant], device) if plan.variant_profile else (None, None)
            ts = times[spec.variant]
            stats = _summary(ts)
            options = ATTENTION_VARIANTS[spec.variant]
            rows.append(
                {
                    "section": "variants",
                    "group": f"L{shape.length}",
                    "label": spec.label,
                    "impl": spec.impl,
                    "score": spec.score,
                    "variant": spec.variant,
                    "options": " ".join(f"{k}={v}" for k, v in options.items()) or "(reference)",
                    "fast_path": fast[spec.variant],
                    **asdict(shape),
                    **stats,
                    "reps": len(ts),
                    "tokens_per_s": shape.tokens / (stats["median_ms"] / 1e3),
                    "peak_mb": peak_mb,
                    "sdpa_kernel": kernel,
                    "ratio_torch": None,
                    "ratio_scaled_dot": statistics.median(ts) / ref,
                }
            )
        del steps
    return rows


def _mha_step(module: nn.Module, shape: Shape, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    module.to(device).train()
    x = torch.randn(shape.batch, shape.length, shape.d_model, generator=torch.Generator().manual_seed(0)).to(device)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    is_torch = isinstance(module, nn.MultiheadAttention)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            out = module(x, x, x, need_weights=False)[0] if is_torch else module(x)[0]
        out.float().square().mean().backward()
        opt.step()

    return step


def bench_mha(plan: Plan, device: torch.device, dtype: torch.dtype, log: Callable[[str], None]) -> list[dict]:
    """The attention module alone: attnlab ``MultiHeadAttention`` (scaled_dot) against ``nn.MultiheadAttention``
    (batch_first, no dropout), one training step on x (B, L, d_model) with loss mean(out²)."""
    rows = []
    for shape in plan.mha_shapes:
        torch.manual_seed(0)
        steps = {
            "torch": _mha_step(
                nn.MultiheadAttention(shape.d_model, shape.num_heads, batch_first=True), shape, device, dtype
            ),
            "scaled_dot": _mha_step(
                MultiHeadAttention(shape.d_model, shape.num_heads, shape.d_k), shape, device, dtype
            ),
        }
        log(f"mha: {shape.tag()} ...")
        times = interleaved_times(steps, plan.warmup, 2 * plan.reps, device)
        ref = statistics.median(times["torch"])
        for name, ts in times.items():
            stats = _summary(ts)
            rows.append(
                {
                    "section": "mha",
                    "label": f"{name} {shape.tag()}",
                    "impl": "torch" if name == "torch" else "attnlab",
                    "score": name,
                    **asdict(shape),
                    **stats,
                    "reps": len(ts),
                    "tokens_per_s": shape.tokens / (stats["median_ms"] / 1e3),
                    "ratio_torch": statistics.median(ts) / ref,
                }
            )
    return rows


def bench_diagnostics(plan: Plan, threads: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Whole-run wall time of ``attnlab.training.run`` on the default config (logger none, no progress bar), with
    diagnostics enabled and disabled, interleaved after one warm-up run (with diagnostics, so that every import,
    matplotlib's included, happens before the timings); also the seconds spent inside the callback's hooks."""
    from hydra import compose, initialize_config_dir

    import attnlab.callbacks as C
    from attnlab import training as T
    from attnlab.callbacks import AttentionDiagnostics

    class TimedDiagnostics(AttentionDiagnostics):
        seconds = 0.0

        def _timed(self, hook: Callable[..., Any], *args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return hook(*args)
            finally:
                TimedDiagnostics.seconds += time.perf_counter() - t0

        def on_train_start(self, *args: Any) -> None:
            self._timed(super().on_train_start, *args)

        def on_train_batch_end(self, *args: Any) -> None:
            self._timed(super().on_train_batch_end, *args)

        def on_train_end(self, *args: Any) -> None:
            self._timed(super().on_train_end, *args)

    base = [
        "logger=none",
        "results_table=false",
        f"threads={threads}",
        "+trainer.enable_progress_bar=false",
        *plan.diag_overrides,
    ]
    walls: dict[str, list[float]] = {"with": [], "without": []}
    callback_s: list[float] = []
    original = C.AttentionDiagnostics
    C.AttentionDiagnostics = TimedDiagnostics  # type: ignore[misc]  # what the run builds its callback from
    try:
        with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(str(T.CONF_DIR), version_base="1.3"):
            cfgs = {
                "with": compose("config", overrides=[*base, "diagnostics.enabled=true"]),
                "without": compose("config", overrides=[*base, "diagnostics.enabled=false"]),
            }
            log("diagnostics: warm-up run ...")  # with diagnostics: imports matplotlib too, outside the timings
            with contextlib.redirect_stdout(sys.stderr):
                T.run(cfgs["with"], Path(tmp) / "warmup")
            for i in range(plan.diag_pairs):
                for arm in ("with", "without"):
                    log(f"diagnostics: run {i + 1}/{plan.diag_pairs} {arm} ...")
                    TimedDiagnostics.seconds = 0.0
                    t0 = time.perf_counter()
                    with contextlib.redirect_stdout(sys.stderr):
                        T.run(cfgs[arm], Path(tmp) / f"{arm}{i}")
                    walls[arm].append(time.perf_counter() - t0)
                    if arm == "with":
                        callback_s.append(TimedDiagnostics.seconds)
            steps = int(cfgs["with"].max_steps)
            every = int(cfgs["with"].diagnostics.every_n_steps)
    finally:
        C.AttentionDiagnostics = original  # type: ignore[misc]
        torch.set_num_threads(threads)
    with_s, without_s = statistics.median(walls["with"]), statistics.median(walls["without"])
    return {
        "max_steps": steps,
        "every_n_steps": every,
        "wall_with_s": walls["with"],
        "wall_without_s": walls["without"],
        "median_with_s": with_s,
        "median_without_s": without_s,
        "callback_s": callback_s,
        "ratio": with_s / without_s,
    }


def naive_additive_logits(q: Tensor, k: Tensor, w_q: Tensor, w_k: Tensor, v: Tensor) -> Tensor:
    """Bahdanau's score materialising the whole (B, H, Lq, Lk, d_a) activation: q (B, H, Lq, d_k), k (B, H, Lk,
    d_k), w_q, w_k (H, d_k, d_a), v (H, d_a) → logits (B, H, Lq, Lk)."""
    wq = torch.matmul(q, w_q)  # (B, H, Lq, d_a)
    uk = torch.matmul(k, w_k)  # (B, H, Lk, d_a)
    t = torch.tanh(wq[:, :, :, None, :] + uk[:, :, None, :, :])  # (B, H, Lq, Lk, d_a)
    H, A = v.shape
    return torch.matmul(t, v.view(1, H, 1, A, 1)).squeeze(-1)


def _additive_memory_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: forward + backward of the additive score (``form`` ``chunked`` = AdditiveScore,
    ``naive`` = :func:`naive_additive_logits`) → peak RSS growth (MB), seconds; saves logits and gradients."""
    torch.set_num_threads(int(spec["threads"]))
    B, H, L, d = spec["batch"], spec["num_heads"], spec["length"], spec["d_k"]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, d, generator=gen).requires_grad_()
    k = torch.randn(B, H, L, d, generator=gen).requires_grad_()
    cotangent = torch.randn(B, H, L, L, generator=gen)
    torch.manual_seed(1)
    score = AdditiveScore(d, H)
    params = (score.w_q, score.w_k, score.v)

    def run(q: Tensor, k: Tensor, cot: Tensor) -> Tensor:
        if spec["form"] == "chunked":
            logits = score(q, k)
        else:
            logits = naive_additive_logits(q, k, *params)
        logits.backward(cot)
        return logits.detach()

    small = (q[:, :, :8].detach().requires_grad_(), k[:, :, :8].detach().requires_grad_())
    run(*small, cotangent[:, :, :8, :8])  # first-call set-up (thread pools, kernels) outside the measurement
    score.zero_grad(set_to_none=True)
    before, method = _reset_peak_rss()
    t0 = time.perf_counter()
    logits = run(q, k, cotangent)
    seconds = time.perf_counter() - t0
    after = _peak_rss_kb(method)
    torch.save({"logits": logits, "grads": [q.grad, k.grad, *(p.grad for p in params)]}, spec["save"])
    return {"form": spec["form"], "peak_mb": max(0, after - before) / 1024, "seconds": seconds, "method": method}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> tuple[int, str]:
    """Reset the process's peak-RSS mark where Linux allows it (``5`` → /proc/self/clear_refs, so that a peak
    from start-up does not hide the one measured) → (current RSS in KB, method)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kb("VmRSS"), "VmHWM"
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"


def _peak_rss_kb(method: str) -> int:
    if method == "VmHWM":
        return _status_kb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def bench_additive_memory(plan: Plan, threads: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Peak memory of the additive score's forward + backward, chunked against naive, one fresh subprocess each;
    their logits and gradients compared (largest difference relative to the largest magnitude)."""
    s = plan.memory_shape
    out: dict[str, Any] = {
        "batch": s.batch,
        "num_heads": s.num_heads,
        "length": s.length,
        "d_k": s.d_k,
        "d_attn": s.d_k,
        "naive_elements": s.batch * s.num_heads * s.length**2 * s.d_k,
    }
    saved: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # one at a time (their seconds are reported too); with --quick both at once, to save a start-up
        batches = [("chunked", "naive")] if plan.quick else [("chunked",), ("naive",)]
        for forms in batches:
            log(f"additive memory: {' and '.join(forms)} at {s.tag()} ...")
            procs = {}
            for form in forms:
                spec = {**asdict(s), "form": form, "threads": threads, "save": str(Path(tmp) / f"{form}.pt")}
                procs[form] = subprocess.Popen(
                    [sys.executable, "-m", "attnlab.bench", "--child", json.dumps(spec)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            for form, proc in procs.items():
                stdout, stderr = proc.communicate()
                if proc.returncode != 0:
                    raise RuntimeError(f"additive memory child ({form}) failed:\n{stderr[-2000:]}")
                result = json.loads(stdout.strip().splitlines()[-1])
                out[f"{form}_peak_mb"] = result["peak_mb"]
                out[f"{form}_seconds"] = result["seconds"]
                out["method"] = result["method"]
                saved[form] = torch.load(Path(tmp) / f"{form}.pt", weights_only=True)
    worst = 0.0
    pairs = [(saved["chunked"]["logits"], saved["naive"]["logits"])]
    pairs += list(zip(saved["chunked"]["grads"], saved["naive"]["grads"], strict=True))
    for a, b in pairs:
        worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)))
    out["max_rel_diff"] = worst
    out["ratio"] = out["chunked_peak_mb"] / max(out["naive_peak_mb"], 1e-9)
    return out


def bench_default_run(log: Callable[[str], None]) -> dict[str, Any]:
    """Wall time of ``python train.py`` with the default config (W&B offline, diagnostics, checkpoints), from the
    repository root, run folder in a temporary directory."""
    script = REPO_ROOT / "train.py"
    if not script.exists():
        return {"skipped": "train.py not found next to the package"}
    log("default run: python train.py ...")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(script), f"hydra.run.dir={tmp}/run"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        wall = time.perf_counter() - t0
        loaded = load_run(Path(tmp) / "run")
        summary = loaded.summary or {}
    if proc.returncode != 0:
        return {"skipped": f"train.py failed: {proc.stderr.strip().splitlines()[-1:]}", "wall_s": wall}
    metrics = summary.get("metrics", {})
    return {
        "wall_s": wall,
        "run_wall_time_s": summary.get("wall_time_s"),
        "threads": summary.get("threads"),
        "val_acc_best": metrics.get("val/acc_best"),
        "test_acc": metrics.get("test/acc"),
    }


def check_fused_sdpa(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16, score: str = "scaled_dot", length: int = 128
) -> str:
    """Forward + backward of an attnlab ``MultiHeadAttention(score)`` with SDPA limited to the fused kernels
    (flash, memory-efficient) → the kernel that ran. Raises :class:`FusedKernelUnavailable`, with the reason,
    when SDPA cannot dispatch to one of them (then the fast path silently used the math kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device(device)
    torch.manual_seed(0)
    mha = MultiHeadAttention(128, 4, 32, score=score).to(device)
    x = torch.randn(2, length, 128, device=device, requires_grad=True)
    try:
        with (
            warnings.catch_warnings(record=True) as caught,
            sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]),
        ):
            warnings.simplefilter("always")

            def step() -> None:
                with _autocast(device, dtype):
                    out, _ = mha(x)
                out.float().sum().backward()

            _, kernel = profile_step(step, device)
    except RuntimeError as exc:
        why = [str(w.message).split(" (Triggered")[0] for w in caught]
        reason = " ".join(" ".join([*why, str(exc)]).split())[:600]
        raise FusedKernelUnavailable(
            f"SDPA could not dispatch attnlab '{score}' to a fused kernel (flash or memory-efficient) on "
            f"{device} in {str(dtype).removeprefix('torch.')}: {reason}"
        ) from exc
    return kernel


# ============================================================================================ report


def machine_info(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Platform, CPU model (/proc/cpuinfo), cores, GPU, torch version, threads, date (UTC)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
    }


def _find(rows: list[dict], group: str, score: str) -> dict | None:
    """The first row of ``score`` in ``group`` (each group lists its base shape first)."""
    return next((r for r in rows if r["group"] == group and r["score"] == score), None)


def evaluate_targets(plan: Plan, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target (issue 6's, then the variants' :data:`VARIANT_GOALS`): id, what, value (a ratio, or seconds),
    limit (None = reported only), met."""
    rows = results.get("encoder", [])
    targets: list[dict[str, Any]] = []

    def add(tid: str, what: str, value: float | None, limit: float | None, note: str = "") -> None:
        met = None if value is None or limit is None or plan.quick else bool(value <= limit)
        targets.append({"id": tid, "what": what, "value": value, "limit": limit, "met": met, "note": note})

    s = plan.target_short
    r = _find(rows, "torch_ab", "scaled_dot")
    add("1", f"scaled_dot encoder step ÷ torch ({s.tag()})", r and r["ratio_torch"], 1.05)
    d = results.get("diagnostics")
    add("2", "training with diagnostics ÷ without (default config)", d and d["ratio"], 1.05)
    for variant in ("relative_position", "t5_bias", "alibi"):
        r = _find(rows, f"L{plan.target_long_length}", variant)
        kernel = r["sdpa_kernel"] if r else ""
        what = f"{variant} step ÷ scaled_dot (L={plan.target_long_length})"
        add("3", what, r and r["ratio_scaled_dot"], 1.5, kernel)
    m = results.get("additive_memory")
    note = ""
    if m is not None:
        note = f"max rel diff {m['max_rel_diff']:.1e}; {m['chunked_peak_mb']:.0f} / {m['naive_peak_mb']:.0f} MB"
    add("4", f"additive peak memory ÷ naive (L={plan.memory_shape.length})", m and m["ratio"], 0.25, note)
    r = _find(rows, f"L{plan.target_additive_length}", "additive")
    add("4b", f"additive step ÷ scaled_dot (L={plan.target_additive_length})", r and r["ratio_scaled_dot"], None)
    dr = results.get("default_run")
    add("5", "default `python train.py` wall time (s)", dr.get("wall_s") if dr else None, None)
    fused = results.get("fused")
    if fused is not None:
        ok = fused.get("kernel") is not None  # a yes/no check, valid at any size
        targets.append(
            {
                "id": "6",
                "what": f"scaled_dot dispatches to a fused SDPA kernel ({results['machine']['device']})",
                "value": fused.get("kernel") or fused.get("error"),
                "limit": "flash|efficient",
                "met": ok,
                "note": "",
            }
        )
    variants = results.get("variants")
    if variants is not None:
        length = plan.target_variant_length
        for tid, names, limit in VARIANT_GOALS:
            for name in names:
                r = next((r for r in variants if r["variant"] == name and r["length"] == length), None)
                note = "" if r is None else ("fast path" if r["fast_path"] else "eager")
                add(tid, f"{name} step ÷ scaled_dot (L={length})", r and r["ratio_scaled_dot"], limit, note)
    return targets


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) < 1e5 else f"{v:.3g}"
    return str(v)


def format_tables(results: dict[str, Any]) -> str:
    """Markdown tables: targets, then the encoder grid (ratios to torch and to scaled_dot)."""
    m = results["machine"]
    lines = [
        f"attnlab bench · {m['date']} · {m['cpu_model']} ({m['usable_cores']} cores) · torch {m['torch']} · "
        f"{m['threads']} threads · {m['device']} {m['dtype']}",
        "",
    ]
    if results.get("quick"):
        lines += [QUICK_NOTE, ""]
    lines += [
        "| target | what | value | limit | met |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in results["targets"]:
        note = f" ({t['note']})" if t["note"] else ""
        lines.append(f"| {t['id']} | {t['what']}{note} | {_fmt(t['value'])} | {_fmt(t['limit'])} | {_fmt(t['met'])} |")
    enc = results.get("encoder") or []
    if enc:
        lines += [
            "",
            "| model | L | B | H | d_k | step ms | tokens/s | peak MB | SDPA | ÷ torch | ÷ scaled_dot |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in enc:
            lines.append(
                f"| {r['score']} | {r['length']} | {r['batch']} | {r['num_heads']} | {r['d_k']} | "
                f"{r['median_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['peak_mb']:.0f} | {r['sdpa_kernel']} | "
                f"{_fmt(r['ratio_torch'])} | {_fmt(r['ratio_scaled_dot'])} |"
            )
    variants = results.get("variants") or []
    if variants:
        lines += ["", *format_variants(variants)]
    mha = results.get("mha") or []
    if mha:
        lines += ["", "| module | shape | step ms | ÷ torch |", "| --- | --- | --- | --- |"]
        for r in mha:
            shape = Shape(r["batch"], r["length"], r["d_model"], r["num_heads"], r["d_k"])
            lines.append(f"| {r['score']} | {shape.tag()} | {r['median_ms']:.2f} | {r['ratio_torch']:.2f} |")
    return "\n".join(lines)


def format_variants(rows: list[dict]) -> list[str]:
    """The variants table: per variant, whether it takes the fast path (with the SDPA kernel that ran when it was
    profiled), then per length its step ÷ scaled_dot and median step (ms); the first line names the shapes."""
    lengths = sorted({r["length"] for r in rows})
    cell = {(r["variant"], r["length"]): r for r in rows}
    shapes = ", ".join(
        Shape(r["batch"], r["length"], r["d_model"], r["num_heads"], r["d_k"]).tag()
        for r in rows
        if r["variant"] == "scaled_dot"
    )
    lines = [
        f"variants: encoder training step ÷ scaled_dot's in the same rounds ({shapes}; {rows[0]['num_layers']} layers)",
        "",
        "| variant | options | fast path | " + " | ".join(f"÷ scaled_dot L={n} (ms)" for n in lengths) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in lengths) + " |",
    ]
    for name in dict.fromkeys(r["variant"] for r in rows):
        first = next(r for r in rows if r["variant"] == name)
        cells = []
        for n in lengths:
            r = cell.get((name, n))
            cells.append("-" if r is None else f"{_fmt(r['ratio_scaled_dot'])} ({r['median_ms']:.1f})")
        fast = {True: "yes", False: "no (eager)", None: "-"}[first["fast_path"]]
        if first["fast_path"] and first["sdpa_kernel"]:
            fast += f" ({first['sdpa_kernel']})"
        lines.append(f"| {name} | {first['options']} | {fast} | " + " | ".join(cells) + " |")
    return lines


CSV_FIELDS = (
    "section",
    "group",
    "label",
    "impl",
    "score",
    "variant",
    "fast_path",
    "batch",
    "length",
    "d_model",
    "num_heads",
    "d_k",
    "num_layers",
    "median_ms",
    "min_ms",
    "max_ms",
    "reps",
    "tokens_per_s",
    "peak_mb",
    "sdpa_kernel",
    "ratio_torch",
    "ratio_scaled_dot",
)
TARGET_FIELDS = ("id", "what", "value", "limit", "met", "note")


RESULTS_ROOT = Path("bench_results")
QUICK_NOTE = (
    "QUICK RUN (--quick): tiny shapes and few repetitions to check that every section runs; its numbers are not "
    "comparable to the goals, which are not judged."
)


def new_results_dir(root: Path, quick: bool) -> Path:
    """A new folder ``root/<UTC date-time>[-quick]`` (never one an earlier run wrote), and ``root/latest``
    pointing at it."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = root / (stamp + ("-quick" if quick else ""))
    n = 1
    while out.exists():
        n += 1
        out = root / f"{stamp}{'-quick' if quick else ''}-{n}"
    out.mkdir(parents=True)
    latest = root / "latest"
    with contextlib.suppress(OSError):
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(out.name, target_is_directory=True)
    return out


def write_results(results: dict[str, Any], out: Path) -> list[Path]:
    """``bench.json`` (everything), ``bench.csv`` (one row per model), ``targets.csv`` → the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.csv", out / "targets.csv"]
    paths[0].write_text(json.dumps(results, indent=2, default=str) + "\n")
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in [*results.get("encoder", []), *results.get("variants", []), *results.get("mha", [])]:
            writer.writerow(row)
    with paths[2].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=TARGET_FIELDS)
        writer.writeheader()
        writer.writerows(results["targets"])
    return paths


# ============================================================================================ entry point


@dataclass
class Options:
    """Command-line options (see ``--help``)."""

    quick: bool = False
    out: Path | None = None
    device: str = "cpu"
    dtype: str = "fp32"
    threads: int | None = None
    only: list[str] = field(default_factory=lambda: list(SECTIONS))
    warmup: int | None = None
    reps: int | None = None


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_bench(opts: Options, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the selected sections → the results dict (machine, sections, targets)."""
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    dtype = DTYPES[opts.dtype]
    threads = opts.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    plan = quick_plan() if opts.quick else full_plan()
    if opts.warmup is not None:
        plan.warmup = opts.warmup
    if opts.reps is not None:
        plan.reps = plan.variant_reps = opts.reps
    results: dict[str, Any] = {"machine": machine_info(device, dtype), "quick": opts.quick, "section_seconds": {}}
    started = time.perf_counter()
    clock = [started]

    def lap(name: str) -> None:
        now = time.perf_counter()
        results["section_seconds"][name] = now - clock[0]
        clock[0] = now

    if "fused" in opts.only:
        try:
            results["fused"] = {"kernel": check_fused_sdpa(device, dtype), "error": None}
        except FusedKernelUnavailable as exc:
            if device.type == "cuda":
                raise
            results["fused"] = {"kernel": None, "error": str(exc)}
        lap("fused")
    if "encoder" in opts.only:
        results["encoder"] = bench_encoder(plan, device, dtype, log)
        lap("encoder")
    if "mha" in opts.only:
        results["mha"] = bench_mha(plan, device, dtype, log)
        lap("mha")
    if "variants" in opts.only:
        results["variants"] = bench_variants(plan, device, dtype, log)
        lap("variants")
    if "diagnostics" in opts.only and device.type == "cpu":
        results["diagnostics"] = bench_diagnostics(plan, threads, log)
        lap("diagnostics")
    if "additive_memory" in opts.only and device.type == "cpu":
        results["additive_memory"] = bench_additive_memory(plan, threads, log)
        lap("additive_memory")
    if "default_run" in opts.only and not opts.quick:
        results["default_run"] = bench_default_run(log)
        lap("default_run")
    results["seconds"] = time.perf_counter() - started
    results["targets"] = evaluate_targets(plan, results)
    return results


def parse_args(argv: Sequence[str] | None = None) -> Options | dict[str, Any]:
    """Parse the command line → :class:`Options` (or a child-process spec with ``--child``)."""
    p = argparse.ArgumentParser(prog="attnlab-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, a smoke run of every section (seconds)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for bench.json/csv, targets.csv (default: a new one under bench_results/)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="autocast dtype (bf16 on GPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default $OMP_NUM_THREADS or cores)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per model (default 2; quick 1)")
    p.add_argument("--reps", type=int, default=None, help="timed interleaved rounds (default 7; quick 3, variants 1)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        return json.loads(a.child)
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return Options(a.quick, a.out, a.device, a.dtype, a.threads, only, a.warmup, a.reps)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m attnlab.bench`` / ``attnlab-bench``."""
    opts = parse_args(argv)
    if isinstance(opts, dict):
        print(json.dumps(_additive_memory_child(opts)), flush=True)
        return

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    try:
        results = run_bench(opts, log)
    except FusedKernelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    out = opts.out or new_results_dir(RESULTS_ROOT, opts.quick)
    paths = write_results(results, out)
    print(format_tables(results))
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({results['seconds']:.0f} s)")
    if opts.out is None:
        print(f"latest results: {RESULTS_ROOT / 'latest'} -> {out.name}")
    if opts.quick:
        print("quick run: not judged against the goals (run without --quick for that)")
    elif any(t["met"] is False for t in results["targets"]):
        print("some targets were missed (see the README's Performance section for why)")


if __name__ == "__main__":
    main()
