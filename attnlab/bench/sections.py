"""The sections of the benchmark, each a function returning its results: ``encoder`` (:func:`bench_encoder`),
``mha``, ``variants``, ``blocks``, ``linear``, ``decode``, ``diagnostics``, ``additive_memory`` (with the
fresh-process child it starts through ``python -m attnlab.bench --child``), ``default_run`` and ``fused``
(:func:`check_fused_sdpa`). The training-step sections (encoder, variants, blocks, linear) also count one step's
FLOPs per model (matrix products only, :func:`~attnlab.bench.harness.count_step_flops`) and give its achieved
FLOP/s; the roofline fraction is added by the caller once the run's peak is measured."""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.attention import MultiHeadAttention
from attnlab.bench.cases import (
    BLOCK_MODELS,
    DECODE_MODELS,
    LINEAR_MODELS,
    ModelSpec,
    Plan,
    Shape,
    _fast_path,
    attention_variants,
    build_blocks,
    build_causal_model,
    build_decode_model,
    build_model,
)
from attnlab.bench.harness import (
    _autocast,
    _peak_rss_kb,
    _reset_peak_rss,
    _summary,
    count_step_flops,
    flops_fields,
    interleaved_times,
    make_train_step,
    profile_step,
)
from attnlab.kernels import tiled
from attnlab.runs import load_run
from attnlab.scores import AdditiveScore

__all__ = [
    "REPO_ROOT",
    "FusedKernelUnavailable",
    "bench_additive_memory",
    "bench_decode",
    "bench_default_run",
    "bench_diagnostics",
    "bench_encoder",
    "bench_linear",
    "bench_mha",
    "bench_variants",
    "check_fused_sdpa",
    "naive_additive_logits",
]

REPO_ROOT = Path(__file__).resolve().parents[2]


class FusedKernelUnavailable(RuntimeError):
    """SDPA could not dispatch an attention call to a fused kernel (flash or memory-efficient)."""


def bench_encoder(plan: Plan, device: torch.device, dtype: torch.dtype, log: Callable[[str], None]) -> list[dict]:
    """Time every group of ``plan`` → one row per model (median step, tokens/s, peak MB, SDPA kernel, ratios, the
    step's FLOPs and achieved FLOP/s: one counted step per model, after the timings)."""
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
            try:
                peak_mb, kernel = profile_step(steps[spec.label], device)
            except Exception as exc:  # the timings stand without the profile: one row's columns, not the section
                why = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"bench: {spec.label}: the profiled step failed ({why})", stacklevel=2)
                peak_mb, kernel = float("nan"), f"error: {type(exc).__name__}"
            flops = count_step_flops(steps[spec.label])
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
                    **flops_fields(flops, stats["median_ms"]),
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
    unless ``plan.variant_profile`` is False) and one counted step each (FLOPs) → one row per model, with
    ``ratio_scaled_dot`` (median step ÷ the ``scaled_dot`` variant's at that length), ``ratio_causal`` (for a causal
    variant: ÷ ``scaled_dot_causal``'s, SDPA's causal kernel; else None), ``fast_path`` (whether its
    attention dispatches to SDPA), ``backend`` (the backend its first layer's training step runs:
    ``MultiHeadAttention.backend_for(device, dtype)``), ``flops`` and ``achieved_flops_s``."""
    reps = plan.variant_reps if plan.variant_reps is not None else plan.reps
    rows: list[dict] = []
    for shape in plan.variant_shapes:
        specs = [ModelSpec.of_variant(name, shape) for name in attention_variants()]
        steps, fast, backend = {}, {}, {}
        for spec in specs:
            model = build_model(spec)
            fast[spec.variant] = _fast_path(model)
            backend[spec.variant] = model.encoder.layers[0].self_attn.backend_for(device, dtype)
            steps[spec.variant] = make_train_step(model, shape.batch, shape.length, device, dtype)
        log(f"variants: {shape.tag()}, {len(specs)} models ...")
        times = interleaved_times(steps, plan.warmup, reps, device)
        ref = statistics.median(times["scaled_dot"])
        ref_causal = statistics.median(times["scaled_dot_causal"]) if "scaled_dot_causal" in times else None
        for spec in specs:
            peak_mb, kernel = profile_step(steps[spec.variant], device) if plan.variant_profile else (None, None)
            flops = count_step_flops(steps[spec.variant])
            ts = times[spec.variant]
            stats = _summary(ts)
            options = attention_variants()[spec.variant]
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
                    "backend": backend[spec.variant],
                    **asdict(shape),
                    **stats,
                    "reps": len(ts),
                    "tokens_per_s": shape.tokens / (stats["median_ms"] / 1e3),
                    "peak_mb": peak_mb,
                    "sdpa_kernel": kernel,
                    "ratio_torch": None,
                    "ratio_scaled_dot": statistics.median(ts) / ref,
                    "ratio_causal": (
                        statistics.median(ts) / ref_causal
                        if ref_causal is not None and options.get("mask") == "causal"
                        else None
                    ),
                    **flops_fields(flops, stats["median_ms"]),
                }
            )
        del steps
    return rows


def _blocks_step(layers: nn.Module, shape: Shape, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    layers.to(device).train()
    x = torch.randn(shape.batch, shape.length, shape.d_model, generator=torch.Generator().manual_seed(0)).to(device)

    def step() -> None:
        layers.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            h = x
            for layer in layers:
                h = layer(h)[0]
            loss = h.float().square().mean()
        loss.backward()

    return step


def bench_blocks(plan: Plan, device: torch.device, dtype: torch.dtype, log: Callable[[str], None]) -> list[dict]:
    """Bare attention block stacks (:func:`~attnlab.bench.cases.build_blocks`), forward + backward of a mean-square
    loss, no optimizer: each group of ``plan.block_groups`` timed together, interleaved, then one profiled step each
    → one row per model with ``ratio_scaled_dot`` (÷ the group's scaled_dot), ``ratio_naive`` (÷ the naive
    additive form, when the group has it), ``flops`` and ``achieved_flops_s`` (one counted step each)."""
    rows: list[dict] = []
    for shape, names in plan.block_groups:
        steps = {name: _blocks_step(build_blocks(name, shape), shape, device, dtype) for name in names}
        log(f"blocks: {shape.tag()}, {', '.join(names)} ...")
        times = interleaved_times(steps, plan.warmup, plan.reps, device)
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        for name in names:
            peak_mb, kernel = profile_step(steps[name], device)
            flops = count_step_flops(steps[name])
            stats = _summary(times[name])
            score, params = BLOCK_MODELS[name]
            rows.append(
                {
                    "section": "blocks",
                    "group": f"L{shape.length}",
                    "label": f"{name} {shape.tag()}",
                    "impl": "attnlab",
                    "score": score if isinstance(score, str) else score.__name__,
                    "variant": name,
                    "options": " ".join(f"{k}={v}" for k, v in params.items()),
                    **asdict(shape),
                    **stats,
                    "reps": len(times[name]),
                    "tokens_per_s": shape.tokens / (stats["median_ms"] / 1e3),
                    "peak_mb": peak_mb,
                    "sdpa_kernel": kernel,
                    "ratio_torch": None,
                    "ratio_scaled_dot": medians[name] / medians["scaled_dot"] if "scaled_dot" in medians else None,
                    "ratio_naive": medians[name] / medians["additive_naive"] if "additive_naive" in medians else None,
                    **flops_fields(flops, stats["median_ms"]),
                }
            )
        del steps
    return rows


def bench_linear(plan: Plan, device: torch.device, dtype: torch.dtype, log: Callable[[str], None]) -> list[dict]:
    """Causal language-model training steps (2 layers, forward + backward + AdamW) of every one of
    :data:`~attnlab.bench.cases.LINEAR_MODELS` at each of ``plan.linear_shapes`` (4096 tokens per batch): the
    models of a length timed together, interleaved, then one profiled step each → one row per model with
    ``ratio_scaled_dot`` (median step ÷ scaled_dot's, SDPA's causal kernel) and ``memory_ratio`` (peak MB ÷
    scaled_dot's), the backend and the state size of the first layer (floats per sequence), ``flops`` and
    ``achieved_flops_s`` (one counted step each; the count ignores a causal mask's sparsity, as torch's SDPA formula
    does, so causal softmax's is about twice the work its kernel does)."""
    rows: list[dict] = []
    for shape in plan.linear_shapes:
        models = {name: build_causal_model(name, shape) for name in LINEAR_MODELS}
        steps = {name: make_train_step(m, shape.batch, shape.length, device, dtype) for name, m in models.items()}
        log(f"linear: {shape.tag()}, {', '.join(models)} ...")
        times = interleaved_times(steps, plan.warmup, plan.reps, device)
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        peaks = {name: profile_step(steps[name], device) for name in models}
        flops = {name: count_step_flops(steps[name]) for name in models}
        for name, model in models.items():
            attn = model.encoder.layers[0].self_attn
            stats = _summary(times[name])
            rows.append(
                {
                    "section": "linear",
                    "group": f"L{shape.length}",
                    "label": f"{name} {shape.tag()}",
                    "impl": "attnlab",
                    "score": attn.config.score,
                    "variant": name,
                    "options": attn.config.describe(),
                    "backend": attn.backend_for(device, dtype),
                    "state_size": attn.state_size(shape.length),
                    **asdict(shape),
                    **stats,
                    "reps": len(times[name]),
                    "tokens_per_s": shape.tokens / (stats["median_ms"] / 1e3),
                    "peak_mb": peaks[name][0],
                    "sdpa_kernel": peaks[name][1],
                    "ratio_torch": None,
                    "ratio_scaled_dot": medians[name] / medians["scaled_dot"],
                    "memory_ratio": peaks[name][0] / peaks["scaled_dot"][0] if peaks["scaled_dot"][0] else None,
                    **flops_fields(flops[name], stats["median_ms"]),
                }
            )
        del steps, models
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
    """Whole-run wall time of ``attnlab.training.run`` on the default config (logger none, no progress bar) in three
    arms, interleaved after one warm-up run (with everything, so that every import, matplotlib's included, happens
    before the timings): ``without`` diagnostics; ``with`` the training-time diagnostics (the callback's probes,
    statistics and logs at ``diagnostics.every_n_steps``; ``diagnostics.importance=false``); ``with_heads``, the
    default, which adds the end-of-run head importance and pruning curves (:mod:`attnlab.training.heads`: an
    analysis of the finished model, a fixed cost per run rather than per step). ``ratio`` (target 2) is with ÷
    without, ``ratio_heads`` with_heads ÷ without; also the seconds spent inside the callback's hooks."""
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
    walls: dict[str, list[float]] = {"with": [], "with_heads": [], "without": []}
    callback_s: list[float] = []
    original = C.AttentionDiagnostics
    C.AttentionDiagnostics = TimedDiagnostics  # type: ignore[misc]  # what the run builds its callback from
    try:
        with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(str(T.CONF_DIR), version_base="1.3"):
            cfgs = {
                "with": compose(
                    "config", overrides=[*base, "diagnostics.enabled=true", "diagnostics.importance=false"]
                ),
                "with_heads": compose("config", overrides=[*base, "diagnostics.enabled=true"]),
                "without": compose("config", overrides=[*base, "diagnostics.enabled=false"]),
            }
            log("diagnostics: warm-up run ...")  # with everything: imports matplotlib too, outside the timings
            with contextlib.redirect_stdout(sys.stderr):
                T.run(cfgs["with_heads"], Path(tmp) / "warmup")
            for i in range(plan.diag_pairs):
                for arm in ("with", "with_heads", "without"):
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
    heads_s = statistics.median(walls["with_heads"])
    return {
        "wall_with_heads_s": walls["with_heads"],
        "median_with_heads_s": heads_s,
        "ratio_heads": heads_s / without_s,
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
    """In a fresh process: forward + backward of the additive score (``form`` ``fused`` = AdditiveScore's default
    kernel, ``chunked`` = its PyTorch kernel, ``naive`` = :func:`naive_additive_logits`) → peak RSS growth (MB),
    seconds; saves logits and gradients."""
    torch.set_num_threads(int(spec["threads"]))
    B, H, L, d = spec["batch"], spec["num_heads"], spec["length"], spec["d_k"]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, d, generator=gen).requires_grad_()
    k = torch.randn(B, H, L, d, generator=gen).requires_grad_()
    cotangent = torch.randn(B, H, L, L, generator=gen)
    torch.manual_seed(1)
    score = AdditiveScore(d, H, kernel="chunked" if spec["form"] == "chunked" else "auto")
    params = (score.w_q, score.w_k, score.v)

    def run(q: Tensor, k: Tensor, cot: Tensor) -> Tensor:
        if spec["form"] != "naive":
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


def bench_additive_memory(plan: Plan, threads: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Peak memory of the additive score's forward + backward, fused and chunked against naive, one fresh
    subprocess each; their logits and gradients compared to the naive form's (largest difference relative to the
    largest magnitude). ``ratio``: fused ÷ naive peak."""
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
        batches = [("fused", "chunked", "naive")] if plan.quick else [("fused",), ("chunked",), ("naive",)]
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
    for form in ("fused", "chunked"):
        pairs = [(saved[form]["logits"], saved["naive"]["logits"])]
        pairs += list(zip(saved[form]["grads"], saved["naive"]["grads"], strict=True))
        for a, b in pairs:
            worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)))
    out["max_rel_diff"] = worst
    out["ratio"] = out["fused_peak_mb"] / max(out["naive_peak_mb"], 1e-9)
    out["chunked_ratio"] = out["chunked_peak_mb"] / max(out["naive_peak_mb"], 1e-9)
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


TILED_CASES: tuple[tuple[str, str], ...] = (("t5", "none"), ("causal", "causal"))
"""The ``tiled`` section's cases: (name, mask): a per-head bias over the offsets (T5's table) with no mask, and a
plain causal softmax."""


def _tiled_step(
    tensors: tuple[Tensor, ...], blas: bool | None, keys: Any, bias: Any, causal: bool
) -> Callable[[], None]:
    """Forward + backward of one call: SDPA (``blas`` None, no bias) or the tiled kernel."""
    q, k, v, dz = tensors

    def run() -> None:
        if blas is None:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            z = tiled.tiled_attention(q, k, v, q.shape[-1] ** -0.5, bias=bias, keys=keys, blas=blas)
        z.backward(dz)

    return run


def bench_tiled(plan: Plan, device: torch.device, dtype: torch.dtype, log: Callable[[str], None]) -> list[dict]:
    """attnlab's tiled kernel alone (:mod:`attnlab.kernels.tiled`), forward + backward of one call at the variants'
    shapes (4 heads, d_k 32) beyond the shortest: its block products through PyTorch's BLAS (``tiled_blas``) and
    through its own loops (``tiled_loops``, the fully fused form), against SDPA's flash kernel on the same q, k, v
    without the bias (``sdpa``: the floor the variants are measured against) → one row per (case, length, impl)
    with ``ratio_sdpa``. CPU, float32 only (the kernel's); empty elsewhere."""
    if device.type != "cpu" or dtype != torch.float32 or not tiled.available():
        log("tiled: skipped (the CPU kernel, float32)")
        return []
    rows: list[dict] = []
    gen = torch.Generator().manual_seed(0)
    shapes = plan.variant_shapes[1:] or plan.variant_shapes
    for shape in shapes:
        B, H, L, d = shape.batch, shape.num_heads, shape.length, shape.d_k
        q, k, v = (torch.randn(B, H, L, d, generator=gen).requires_grad_() for _ in range(3))
        dz = torch.randn(B, H, L, d, generator=gen)
        table = torch.randn(H, 2 * L - 1, generator=gen).requires_grad_()
        for case, mask in TILED_CASES:
            causal = mask == "causal"
            keys = tiled.KeyRange(torch.zeros(L, dtype=torch.long), torch.arange(1, L + 1)) if causal else None
            bias = None if causal else tiled.OffsetTable.over_offsets(table, L, L)

            steps = {
                impl: _tiled_step((q, k, v, dz), blas, keys, bias, causal)
                for impl, blas in (("sdpa", None), ("tiled_blas", True), ("tiled_loops", False))
            }
            log(f"tiled: {case}, L {L} ...")
            times = interleaved_times(steps, plan.warmup, plan.reps, device)
            ref = statistics.median(times["sdpa"])
            for impl, ts in times.items():
                rows.append(
                    {
                        "section": "tiled",
                        "group": f"L{L}",
                        "label": f"{case} {impl}",
                        "impl": impl,
                        "variant": case,
                        **asdict(shape),
                        **_summary(ts),
                        "reps": len(ts),
                        "ratio_sdpa": statistics.median(ts) / ref,
                    }
                )
    return rows


def check_fused_sdpa(
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    score: str = "scaled_dot",
    length: int = 128,
    dropout: float = 0.0,
) -> str:
    """Forward + backward of an attnlab ``MultiHeadAttention(score)`` with SDPA limited to the fused kernels
    (flash, memory-efficient) → the kernel that ran (on the CPU, Shaw, T5 and ALiBi run attnlab's ``tiled``
    kernel instead of SDPA, and ``additive`` its own). Raises :class:`FusedKernelUnavailable`, with the reason,
    when SDPA cannot dispatch to one of them (then the fast path silently used the math kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device(device)
    torch.manual_seed(0)
    mha = MultiHeadAttention(128, 4, 32, score=score, dropout=dropout).to(device)
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


def _prefilled(encoder: nn.Module, context: int, device: torch.device, dtype: torch.dtype, batch: int) -> list:
    """A decoding cache as if ``context`` tokens had been decoded: random keys and values (a softmax layer's cache,
    with room for the tokens to come) or a random state (the recurrent forms'), scaled like real ones."""
    from attnlab.decode import init_cache

    cache = init_cache(encoder)
    g = torch.Generator().manual_seed(0)
    for layer, c in zip(encoder.layers, cache, strict=True):
        c.state = layer.self_attn.form.prefill(batch, context, g, device, dtype)
        c.length = context
    return cache


def _latent_floats(model: nn.Module) -> int | None:
    """Σ over the layers of kv_rank + rope_dim for multi-head latent attention (the floats a token's latent cache
    holds by its definition), None for another form."""
    forms = [layer.self_attn.form for layer in model.layers]
    if not all(hasattr(f, "kv_rank") for f in forms):
        return None
    return sum(f.kv_rank + f.rope_dim for f in forms)


def bench_decode(plan: Plan, device: torch.device, dtype: torch.dtype, log: Callable[[str], None]) -> list[dict]:
    """Decoding one token at a time (:mod:`attnlab.decode`, no gradients): for a batch of ``plan.decode_shape.batch``
    sequences at each of ``plan.decode_contexts``, ``plan.decode_tokens`` tokens through every one of
    :data:`~attnlab.bench.cases.DECODE_MODELS` (softmax with a key/value cache of the context; the recurrent forms
    with their state), timed together, interleaved → one row per model and context with ``tokens_per_s``,
    ``ratio_scaled_dot`` (time per token ÷ softmax's), ``bytes_per_seq`` (the cache's bytes per sequence,
    measured from its tensors, after the timed rounds), ``bytes_per_token`` (that ÷ the tokens it then holds, the
    context and the ``decode_tokens``) and, for multi-head latent attention,
    ``latent_floats`` (Σ kv_rank + rope_dim over the layers)."""
    from attnlab.decode import encoder_step

    rows: list[dict] = []
    s = plan.decode_shape
    n = plan.decode_tokens
    tokens = torch.randint(0, 50, (s.batch,), generator=torch.Generator().manual_seed(1)).to(device)
    max_len = max(plan.decode_contexts) + n + 64
    models = {name: build_decode_model(name, s, max_len).to(device, dtype) for name in DECODE_MODELS}
    for context in plan.decode_contexts:
        caches = {name: _prefilled(m, context, device, dtype, s.batch) for name, m in models.items()}

        def steps_of(model: nn.Module, cache: list, context: int) -> Callable[[], None]:
            @torch.no_grad()
            def step() -> None:
                for _ in range(n):
                    encoder_step(model, tokens, cache)
                for c in cache:  # back to the context (a softmax cache overwrites its slots next time)
                    c.length = context

            return step

        log(f"decode: context {context}, batch {s.batch}, {', '.join(models)} ...")
        steps = {name: steps_of(m, caches[name], context) for name, m in models.items()}
        times = interleaved_times(steps, plan.warmup, plan.reps, device)
        medians = {name: statistics.median(ts) / n for name, ts in times.items()}  # seconds per token
        for name, model in models.items():
            attn = model.layers[0].self_attn
            stats = _summary([t / n for t in times[name]])
            rows.append(
                {
                    "section": "decode",
                    "group": f"C{context}",
                    "label": f"{name} context {context}",
                    "impl": "attnlab",
                    "score": attn.config.score,
                    "variant": name,
                    "options": attn.config.describe(),
                    **{**asdict(s), "length": context},
                    **stats,
                    "reps": len(times[name]),
                    "tokens_per_s": s.batch / medians[name],
                    "ratio_scaled_dot": medians[name] / medians["scaled_dot"],
                    "bytes_per_seq": sum(c.nbytes() for c in caches[name]) / s.batch,
                    # the cache holds the context and the n tokens decoded in the timed rounds
                    "bytes_per_token": sum(c.nbytes() for c in caches[name]) / s.batch / (context + n),
                    "bytes_per_float": torch.tensor([], dtype=dtype).element_size(),
                    "latent_floats": _latent_floats(model),
                    "state_size": sum(layer.self_attn.state_size(context) for layer in model.layers),
                }
            )
        del caches, steps
    return rows
