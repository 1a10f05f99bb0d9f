"""``attnlab-bench`` / ``python -m attnlab.bench``: the options, running the selected sections (with the machine's
peak FLOP/s measured first when a training-step section runs, for the roofline column), writing and printing the
results; ``--child`` (internal) runs one additive-memory measurement in a fresh process."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnlab.bench.cases import full_plan, quick_plan
from attnlab.bench.harness import measure_peak
from attnlab.bench.report import (
    RESULTS_ROOT,
    ROOFLINE_SECTIONS,
    add_roofline,
    evaluate_targets,
    format_tables,
    machine_info,
    new_results_dir,
    write_results,
)
from attnlab.bench.sections import (
    FusedKernelUnavailable,
    _additive_memory_child,
    bench_additive_memory,
    bench_blocks,
    bench_decode,
    bench_default_run,
    bench_diagnostics,
    bench_encoder,
    bench_linear,
    bench_mha,
    bench_tiled,
    bench_variants,
    check_fused_sdpa,
)

__all__ = ["DTYPES", "SECTIONS", "Options", "main", "parse_args", "run_bench"]

DESCRIPTION = (  # (the first line of attnlab.bench's docstring: that package imports this module, not back)
    "Benchmark harness: attnlab against PyTorch's own attention, measured side by side in one process."
)

SECTIONS = (
    "fused",
    "encoder",
    "mha",
    "variants",
    "blocks",
    "tiled",
    "linear",
    "decode",
    "diagnostics",
    "additive_memory",
    "default_run",
    "flex",
)
CUDA_ONLY_BY_DEFAULT = ("flex",)
"""Sections that a run without ``--only`` includes on CUDA only: ``flex`` on the CPU times the forward alone and
compiles each configuration first (minutes on 2 cores); name it in ``--only`` to run it there."""


@dataclass
class Options:
    """Command-line options (see ``--help``)."""

    quick: bool = False
    out: Path | None = None
    device: str = "cpu"
    dtype: str = "fp32"
    threads: int | None = None
    only: list[str] | None = None
    """the sections to run; None: every one of :data:`SECTIONS` (those of :data:`CUDA_ONLY_BY_DEFAULT` on CUDA
    only)."""
    warmup: int | None = None
    reps: int | None = None


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_bench(opts: Options, log: Callable[[str], None] = print, partial: Path | None = None) -> dict[str, Any]:
    """Run the selected sections → the results dict (machine, ``peak``: the machine's practical peak FLOP/s,
    measured before the timed sections when one of them has a roofline column, the sections with each training
    step's ``roofline``, targets). With ``partial``, the results so far are written there (JSON) after every
    section, so that a run cut short (a time limit, a lent GPU given back) keeps what it measured."""
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
    if opts.only is None:
        opts.only = [s for s in SECTIONS if device.type == "cuda" or s not in CUDA_ONLY_BY_DEFAULT]
    results: dict[str, Any] = {"machine": machine_info(device, dtype), "quick": opts.quick, "section_seconds": {}}
    started = time.perf_counter()
    clock = [started]

    def lap(name: str) -> None:
        now = time.perf_counter()
        results["section_seconds"][name] = now - clock[0]
        clock[0] = now
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(results, indent=2, default=str) + "\n")

    if "fused" in opts.only:
        try:
            results["fused"] = {"kernel": check_fused_sdpa(device, dtype), "error": None}
        except FusedKernelUnavailable as exc:
            if device.type == "cuda":
                raise
            results["fused"] = {"kernel": None, "error": str(exc)}
        lap("fused")
    if any(name in opts.only for name in ROOFLINE_SECTIONS):
        log(f"peak: {plan.peak_reps} matrix products of {plan.peak_size}² ...")
        results["peak"] = measure_peak(device, dtype, plan.peak_size, plan.peak_reps)
        lap("peak")
    timed = {
        "encoder": bench_encoder,
        "mha": bench_mha,
        "variants": bench_variants,
        "blocks": bench_blocks,
        "tiled": bench_tiled,
        "linear": bench_linear,
        "decode": bench_decode,
    }
    for name, section in timed.items():
        if name in opts.only:
            results[name] = section(plan, device, dtype, log)
            lap(name)
    if "diagnostics" in opts.only and device.type == "cpu":
        results["diagnostics"] = bench_diagnostics(plan, threads, log)
        lap("diagnostics")
    if "additive_memory" in opts.only and device.type == "cpu":
        results["additive_memory"] = bench_additive_memory(plan, threads, log)
        lap("additive_memory")
    if "flex" in opts.only:
        from attnlab.bench.flex import bench_flex

        results["flex"] = bench_flex(plan, device, dtype, log)
        lap("flex")
    if "default_run" in opts.only and not opts.quick:
        results["default_run"] = bench_default_run(log)
        lap("default_run")
    add_roofline(results)
    results["seconds"] = time.perf_counter() - started
    results["targets"] = evaluate_targets(plan, results)
    return results


def parse_args(argv: Sequence[str] | None = None) -> Options | dict[str, Any]:
    """Parse the command line → :class:`Options` (or a child-process spec with ``--child``)."""
    p = argparse.ArgumentParser(prog="attnlab-bench", description=DESCRIPTION)
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
    p.add_argument(
        "--only",
        default=None,
        help=f"comma-separated sections: {', '.join(SECTIONS)} (default: all; flex on CUDA only unless named)",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per model (default 2; quick 1)")
    p.add_argument("--reps", type=int, default=None, help="timed interleaved rounds (default 7; quick 3, variants 1)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        return json.loads(a.child)
    if a.only is None:
        return Options(a.quick, a.out, a.device, a.dtype, a.threads, None, a.warmup, a.reps)
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

    out = opts.out or new_results_dir(RESULTS_ROOT, opts.quick)
    partial = out / "bench.partial.json"
    try:
        results = run_bench(opts, log, partial)
    except FusedKernelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    paths = write_results(results, out)
    partial.unlink(missing_ok=True)
    try:
        print(format_tables(results))
        print(f"\nwrote {', '.join(str(p) for p in paths)} ({results['seconds']:.0f} s)")
        if opts.out is None:
            print(f"latest results: {RESULTS_ROOT / 'latest'} -> {out.name}")
        if opts.quick:
            print("quick run: not judged against the goals (run without --quick for that)")
        elif any(t["met"] is False for t in results["targets"]):
            print("some targets were missed (see the README's Performance section for why)")
        sys.stdout.flush()
    except BrokenPipeError:  # stdout's reader has gone (| head): Python's way (signal docs, "Note on SIGPIPE")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (no second error at the flush on exit)
        raise SystemExit(1) from None
