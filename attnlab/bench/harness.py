"""The timing and memory harness: one training step as a closure (:func:`make_train_step`), interleaved timed
repetitions (:func:`interleaved_times`), one profiled step for the peak memory and the SDPA kernel that ran
(:func:`profile_step`), one counted step for the FLOPs (:func:`count_step_flops`), the machine's practical peak
FLOP/s (:func:`measure_peak`), the summary of a list of times, and the process's peak-RSS mark (the
additive-memory child's measurement)."""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.bench.cases import NUM_CLASSES, VOCAB_SIZE

__all__ = ["count_step_flops", "flops_fields", "interleaved_times", "make_train_step", "measure_peak", "profile_step"]


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
    ("attnlab::tiled_attention", "tiled"),  # attnlab's tiled kernel (a bias, a cap, a sink, sigmoid)
    ("attnlab::relative_attention", "relative"),  # attnlab's fused relative-position kernel (Shaw, T5)
    ("attnlab::additive_logits", "additive"),  # attnlab's fused additive kernel
)


def _kernel_names(names: set[str]) -> str:
    found = [short for needle, short in _KERNELS if any(needle in n and "backward" not in n for n in names)]
    return "+".join(found) if found else "eager"


def profile_step(step: Callable[[], None], device: torch.device) -> tuple[float, str]:
    """Run ``step`` once → (peak MB allocated above the memory held before it, the attention kernel(s) that ran:
    SDPA's ``flash``, ``efficient``, ``cudnn``, ``math``, attnlab's ``tiled``, ``relative`` or ``additive``, or
    ``eager`` when none of these was called).

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


def count_step_flops(step: Callable[[], None]) -> int | None:
    """The FLOPs of one call of ``step`` (a training-step closure: forward + backward, and the optimizer's update,
    which is free), counted by running it once under :func:`attnlab.compute.count_flops`: matrix products only, 2
    FLOPs per multiply-add; softmax, normalisation and elementwise work are free, an operator without a formula
    (a custom kernel :mod:`attnlab.compute` does not know) counts 0. None when the step cannot run under the
    counter (a dispatch mode; with a warning), so that counting never stops the benchmark."""
    from attnlab.compute import count_flops

    try:
        return count_flops(step)
    except Exception as exc:  # a report column: the timings stand without it
        warnings.warn(f"bench: the step's FLOPs could not be counted ({type(exc).__name__}: {exc})", stacklevel=2)
        return None


def flops_fields(flops: int | None, median_ms: float) -> dict[str, Any]:
    """A timed row's ``flops`` (per step) and ``achieved_flops_s`` (flops ÷ the median step); ``roofline`` (achieved ÷
    the peak) is added once the run's peak is known (:func:`attnlab.bench.report.add_roofline`)."""
    achieved = None if flops is None or median_ms <= 0 else flops / (median_ms / 1e3)
    return {"flops": flops, "achieved_flops_s": achieved, "roofline": None}


def measure_peak(device: torch.device, dtype: torch.dtype, size: int = 2048, reps: int = 5) -> dict[str, Any]:
    """The machine's practical peak: ``reps`` timed ``torch.mm`` of two (``size``, ``size``) matrices in the
    benchmark's compute dtype (float32 for an fp32 run; bf16 for ``--dtype bf16``, as autocast runs the matrix
    products), after one untimed call → ``flops_s`` (2·size³ ÷ the median time), ``best_flops_s`` (÷ the fastest),
    ``median_ms``, ``size``, ``reps``, ``dtype``, ``threads``."""
    mm_dtype = torch.float32 if dtype == torch.float32 else dtype
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device, mm_dtype)
    b = torch.randn(size, size, generator=gen).to(device, mm_dtype)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        times.append(time.perf_counter() - t0)
    flops = 2 * size**3
    median = statistics.median(times)
    return {
        "flops_s": flops / median,
        "best_flops_s": flops / min(times),
        "median_ms": 1e3 * median,
        "size": size,
        "reps": reps,
        "dtype": str(mm_dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }


def _summary(times: Sequence[float]) -> dict[str, float]:
    ts = sorted(times)
    return {
        "median_ms": 1e3 * statistics.median(ts),
        "min_ms": 1e3 * ts[0],
        "max_ms": 1e3 * ts[-1],
    }


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
