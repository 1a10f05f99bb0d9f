"""The goals and the report: the machine's description, the targets judged (:func:`evaluate_targets`), the
roofline fraction of each timed training step (:func:`add_roofline`), the markdown tables, and the results folder
(``bench.json``, ``bench.csv``, ``targets.csv``)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from attnlab.bench.cases import (
    BETA_GOAL,
    BLOCK_GOALS,
    DECODE_GOALS,
    GROWING_CACHES,
    LATENT_CACHE_GOAL,
    LINEAR_GOALS,
    RECURRENT_GOALS,
    TILED_GOALS,
    VARIANT_GOALS,
    Plan,
    Shape,
)

__all__ = [
    "CSV_FIELDS",
    "NOT_MEASURED",
    "QUICK_NOTE",
    "RESULTS_ROOT",
    "ROOFLINE_SECTIONS",
    "TARGET_FIELDS",
    "add_roofline",
    "evaluate_targets",
    "format_decode",
    "format_linear",
    "format_tables",
    "format_variants",
    "linear_crossover",
    "machine_info",
    "new_results_dir",
    "write_results",
]

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
    "ratio_causal",
    "ratio_naive",
    "ratio_sdpa",
    "backend",
    "memory_ratio",
    "state_size",
    "bytes_per_seq",
    "flops",
    "achieved_flops_s",
    "roofline",
    "ratio_eager",
    "compile_s",
    "mode",
)
TARGET_FIELDS = ("id", "what", "value", "limit", "met", "note")


RESULTS_ROOT = Path("bench_results")
QUICK_NOTE = (
    "QUICK RUN (--quick): tiny shapes and few repetitions to check that every section runs; its numbers are not "
    "comparable to the goals, which are not judged."
)


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


# The sections whose rows are training steps with a FLOP count, and so a roofline fraction.
ROOFLINE_SECTIONS = ("encoder", "variants", "blocks", "linear")


def add_roofline(results: dict[str, Any]) -> None:
    """Set each timed training-step row's ``roofline``: its ``achieved_flops_s`` (the step's FLOPs ÷ its median
    time) ÷ the run's measured peak (``results["peak"]["flops_s"]``, a large matrix product). The FLOPs are
    matrix-product FLOPs only (:mod:`attnlab.compute`'s convention: softmax, normalisation and elementwise work are
    free, and a causal mask's skipped half is counted), so the fraction is of the matrix-product work a step would
    do at the machine's matrix-product peak: a report, with no goal. None where either is missing."""
    peak = (results.get("peak") or {}).get("flops_s")
    for section in ROOFLINE_SECTIONS:
        for row in results.get(section) or []:
            achieved = row.get("achieved_flops_s")
            row["roofline"] = achieved / peak if achieved is not None and peak else None


NOT_MEASURED = "not measured"
"""The note of a goal whose row (or the row it is compared with) the run did not measure."""


def _row(rows: list[dict], variant: str, length: int) -> dict | None:
    """The row of ``variant`` at ``length`` (None: not measured)."""
    return next((r for r in rows if r["variant"] == variant and r["length"] == length), None)


def _find(rows: list[dict], group: str, score: str) -> dict | None:
    """The first row of ``score`` in ``group`` (each group lists its base shape first)."""
    return next((r for r in rows if r["group"] == group and r["score"] == score), None)


def evaluate_targets(plan: Plan, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target (issue 6's, the blocks', the linear-attention and recurrent rows' (issue 27's, then
    :data:`~attnlab.bench.cases.RECURRENT_GOALS`: issue 31's 31f and issue 42's 42a–c, and issue 42's β goal 42d,
    :data:`~attnlab.bench.cases.BETA_GOAL`), the decoding's (:data:`~attnlab.bench.cases.DECODE_GOALS`: 42e, 28a;
    28b), then the variants' :data:`VARIANT_GOALS`, issue 31's tighter limits among them): id, what, value (a
    ratio, or seconds), limit (None = reported only), met (None in a ``--quick`` run or when not measured; a goal
    set for a row the run did not measure is noted :data:`NOT_MEASURED`)."""
    rows = results.get("encoder", [])
    targets: list[dict[str, Any]] = []

    def add(tid: str, what: str, value: float | None, limit: float | None, note: str = "", floor: bool = False) -> None:
        met = None
        if value is not None and limit is not None and not plan.quick:
            met = bool(value >= limit if floor else value <= limit)
        targets.append({"id": tid, "what": what, "value": value, "limit": limit, "met": met, "note": note})

    s = plan.target_short
    r = _find(rows, "torch_ab", "scaled_dot")
    add("1", f"scaled_dot encoder step ÷ torch ({s.tag()})", r and r["ratio_torch"], 1.05)
    d = results.get("diagnostics")
    add(
        "2",
        "training with diagnostics ÷ without (default config, diagnostics.importance=false)",
        d and d["ratio"],
        1.05,
    )
    note = "" if not d else f"the head analysis: {d['median_with_heads_s'] - d['median_with_s']:.1f} s a run"
    what = "training with diagnostics and the end-of-run head importance and pruning (a single run's default) ÷ without"
    add("2b", what, d and d.get("ratio_heads"), None, note)
    # issue 40: the head step within 10 % of a default run, or off by default where it costs most (sweeps, smoke
    # runs: diagnostics.importance=auto); reported against the run with the training-time diagnostics
    share = None if not d else (d["median_with_heads_s"] - d["median_with_s"]) / d["median_with_s"]
    note = "diagnostics.importance=auto: off in sweeps and smoke runs (true turns it on)"
    add("2c", "the end-of-run head step ÷ the rest of a default single run", share, None, note)
    for variant, limit in (("relative_position", 1.5), ("t5_bias", 1.3), ("alibi", 1.5)):
        r = _find(rows, f"L{plan.target_long_length}", variant)
        kernel = r["sdpa_kernel"] if r else ""
        what = f"{variant} step ÷ scaled_dot (L={plan.target_long_length})"
        add("3", what, r and r["ratio_scaled_dot"], limit, kernel)
    m = results.get("additive_memory")
    note = ""
    if m is not None:
        note = (
            f"max rel diff {m['max_rel_diff']:.1e}; fused {m['fused_peak_mb']:.0f}, chunked "
            f"{m['chunked_peak_mb']:.0f} / naive {m['naive_peak_mb']:.0f} MB"
        )
    add("4", f"additive peak memory ÷ naive (L={plan.memory_shape.length})", m and m["ratio"], 0.25, note)
    r = _find(rows, f"L{plan.target_additive_length}", "additive")
    what = f"additive step ÷ scaled_dot (L={plan.target_additive_length})"
    add("16a", what, r and r["ratio_scaled_dot"], 6.0, r["sdpa_kernel"] if r else "")
    blocks = results.get("blocks")
    if blocks is not None:
        length = plan.target_block_length
        for tid, name, limit, per_naive in BLOCK_GOALS:
            r = next((r for r in blocks if r["variant"] == name and r["length"] == length), None)
            if per_naive:
                value, what = r and r["ratio_naive"], f"{name} ÷ naive (B, H, L, L, d_a) form, blocks (L={length})"
            else:
                value, what = r and r["ratio_scaled_dot"], f"{name} ÷ scaled_dot, blocks (L={length})"
            add(tid, what, value, limit, r["sdpa_kernel"] if r else "")
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
    linear = results.get("linear")
    if linear is not None:
        lengths = plan.target_linear_lengths
        for tid, kind, which, limit in LINEAR_GOALS:
            r = next((r for r in linear if r["variant"] == "linear_elu" and r["length"] == lengths[which]), None)
            if kind == "time":
                add(
                    tid,
                    f"linear (elu, chunked) step ÷ scaled_dot causal (L={lengths[which]})",
                    r and r["ratio_scaled_dot"],
                    limit,
                )
            else:
                note = "" if r is None else f"{r['peak_mb']:.0f} MB; SDPA's CPU flash kernel is O(L) too"
                add(
                    tid,
                    f"linear (elu, chunked) peak memory ÷ scaled_dot causal (L={lengths[which]})",
                    r and r["memory_ratio"],
                    limit,
                    note,
                )
        for tid, names, which, limit in RECURRENT_GOALS:
            for name in names:
                r = _row(linear, name, lengths[which])
                what = f"{name} step ÷ scaled_dot causal (L={lengths[which]})"
                note = NOT_MEASURED if r is None else r.get("backend", "")
                add(tid, what, r and r["ratio_scaled_dot"], limit, note)
        tid, pairs, which, limit = BETA_GOAL
        for name, reference in pairs:
            r, ref = _row(linear, name, lengths[which]), _row(linear, reference, lengths[which])
            what = (
                f"{name} step ÷ {reference} step (L={lengths[which]}; β ∈ (0, 2) vs (0, 1), the same code: the limit "
                "is the 5 % run-to-run noise of interleaved medians on this machine)"
            )
            if r is None or ref is None:
                add(tid, what, None, limit, NOT_MEASURED)
                continue
            note = f"{r['median_ms']:.1f} / {ref['median_ms']:.1f} ms"
            add(tid, what, r["median_ms"] / ref["median_ms"], limit, note)
        crossover = linear_crossover(linear)
        add("27d", "crossover: shortest L where linear (elu) steps faster than scaled_dot", crossover, None)
    decode = results.get("decode")
    if decode is not None:
        longest, shortest = max(plan.decode_contexts), min(plan.decode_contexts)
        named = {name for _, names, _ in DECODE_GOALS if names is not None for name in names}
        present = [r["variant"] for r in decode if r["variant"] not in GROWING_CACHES and r["length"] == longest]
        for tid, names, limit in DECODE_GOALS:
            for name in names if names is not None else [n for n in present if n not in named]:
                r = _row(decode, name, longest)
                what = f"{name} decode time per token ÷ scaled_dot with a KV cache (context {longest})"
                if r is None:
                    add(tid, what, None, limit, NOT_MEASURED)
                    continue
                note = f"{r['tokens_per_s']:.0f} tokens/s; {r['bytes_per_seq'] / 1024:.0f} KiB/seq"
                add(tid, what, r["ratio_scaled_dot"], limit, note)
        for name in present:
            r, first = _row(decode, name, longest), _row(decode, name, shortest)
            what = f"{name} decode memory per sequence, context {longest} ÷ {shortest}"
            value = None if r is None or first is None else r["bytes_per_seq"] / first["bytes_per_seq"]
            add("28b", what, value, 1.0, NOT_MEASURED if value is None else "")
        tid, name, limit = LATENT_CACHE_GOAL
        r, softmax = _row(decode, name, longest), _row(decode, "scaled_dot", longest)
        what = f"{name} cache bytes per token ÷ (kv_rank + rope_dim)·bytes per float·layers (context {longest})"
        if r is None or not r.get("latent_floats"):
            add(tid, what, None, limit, NOT_MEASURED)
        else:
            allowed = r["latent_floats"] * r["bytes_per_float"]
            note = f"{r['bytes_per_token']:.0f} B/token (limit {allowed} B)"
            if softmax is not None:
                note += f"; softmax's key/value cache {softmax['bytes_per_token']:.0f} B/token"
            add(tid, what, r["bytes_per_token"] / allowed, limit, note)
    variants = results.get("variants")
    if variants is not None:
        length = plan.target_variant_length
        for tid, names, limit in VARIANT_GOALS:
            for name in names:
                r = next((r for r in variants if r["variant"] == name and r["length"] == length), None)
                note = "" if r is None else r.get("backend") or ("fast path" if r["fast_path"] else "eager")
                if r is not None and r.get("ratio_causal") is not None:  # a causal variant: ÷ causal scaled_dot
                    add(tid, f"{name} step ÷ scaled_dot causal (L={length})", r["ratio_causal"], limit, note)
                else:
                    add(tid, f"{name} step ÷ scaled_dot (L={length})", r and r["ratio_scaled_dot"], limit, note)
        longer = [n for n in {r["length"] for r in variants} if n > length]
        at = {"target": length, "long": max(longer) if longer else None}
        for tid, names, kind, which, limit in TILED_GOALS:
            for length in (at[w] for w in which if at[w] is not None):
                ref = next((r for r in variants if r["variant"] == "scaled_dot" and r["length"] == length), None)
                for name in names:
                    r = next((r for r in variants if r["variant"] == name and r["length"] == length), None)
                    note = NOT_MEASURED if r is None else r.get("backend") or ""
                    if kind == "time":
                        add(tid, f"{name} step ÷ scaled_dot (L={length})", r and r["ratio_scaled_dot"], limit, note)
                    elif kind == "roofline":
                        what = f"{name} step's matrix-product FLOP/s ÷ the machine's peak (L={length}; at least)"
                        add(tid, what, r and r.get("roofline"), limit, note, floor=True)
                    else:
                        value = None
                        if r is not None and ref is not None and r.get("peak_mb") and ref.get("peak_mb"):
                            value = r["peak_mb"] / ref["peak_mb"]
                            note = f"{note}; {r['peak_mb']:.0f} / {ref['peak_mb']:.0f} MB"
                        add(tid, f"{name} peak memory ÷ scaled_dot's (L={length})", value, limit, note)
    return targets


def linear_crossover(rows: list[dict], model: str = "linear_elu") -> float | None:
    """The shortest measured length from which ``model`` steps faster than scaled_dot at every longer measured
    length (None: at none)."""
    ratios = sorted((r["length"], r["ratio_scaled_dot"]) for r in rows if r["variant"] == model)
    for i, (length, _) in enumerate(ratios):
        if all(ratio < 1.0 for _, ratio in ratios[i:]):
            return float(length)
    return None


def format_linear(rows: list[dict]) -> list[str]:
    """The linear-attention table: per length, each model's step, ratio, peak memory, state size and % of the
    machine's peak (matrix-product FLOPs; causal softmax's counted in full)."""
    lines = [
        "linear: causal encoder training step (2 layers, forward + backward + AdamW; full plan: 4096 tokens a batch)",
        "",
        "| model | backend | L | B | step ms | ÷ scaled_dot | peak MB | ÷ scaled_dot | state (floats/seq/layer) "
        "| % peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['backend']} | {r['length']} | {r['batch']} | {r['median_ms']:.1f} | "
            f"{_fmt(r['ratio_scaled_dot'])} | {_fmt(r['peak_mb'], 0)} | {_fmt(r['memory_ratio'])} | "
            f"{r['state_size']:,} | {_pct(r.get('roofline'))} |"
        )
    return lines


def format_decode(rows: list[dict]) -> list[str]:
    """The decoding table: per context, each model's tokens per second, time per token ÷ softmax's and memory."""
    r0 = rows[0]
    lines = [
        f"decode: one token at a time, batch {r0['batch']}, {r0['num_layers']} layers, d_model {r0['d_model']}, "
        f"H {r0['num_heads']} × d_k {r0['d_k']}, no gradients",
        "",
        "| model | context | ms per token | tokens/s | ÷ scaled_dot | cache KiB/seq |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['length']} | {r['median_ms']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{_fmt(r['ratio_scaled_dot'])} | {r['bytes_per_seq'] / 1024:.0f} |"
        )
    return lines


def format_flex(rows: list[dict]) -> list[str]:
    """The flex table: per configuration and length, each implementation's time and its ratio to ``eager`` (the
    materialised path), with flex's first call (the compile)."""
    r0 = rows[0]
    lines = [
        f"flex: one attention layer, {r0['mode']}, d_model {r0['d_model']}, H {r0['num_heads']} × d_k {r0['d_k']}",
        "",
        "| configuration | L | B | implementation | ms | ÷ eager | first call s (compile) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['length']} | {r['batch']} | {r['impl']} | {r['median_ms']:.2f} | "
            f"{_fmt(r['ratio_eager'])} | {_fmt(r['compile_s'], 1)} |"
        )
    return lines


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) < 1e5 else f"{v:.3g}"
    return str(v)


def _pct(fraction: float | None) -> str:
    """A roofline fraction as a percentage (one decimal), "-" when not measured."""
    return "-" if fraction is None else f"{100 * fraction:.1f}"


def format_tables(results: dict[str, Any]) -> str:
    """Markdown tables: targets, then the encoder grid (ratios to torch and to scaled_dot), the variants, the
    blocks, linear attention, decoding and the module alone. The first line names the machine and its measured
    peak; each training-step table's ``% peak`` column is the step's achieved matrix-product FLOP/s ÷ that peak
    (:func:`add_roofline`)."""
    m = results["machine"]
    peak = results.get("peak")
    lines = [
        f"attnlab bench · {m['date']} · {m['cpu_model']} ({m['usable_cores']} cores) · torch {m['torch']} · "
        f"{m['threads']} threads · {m['device']} {m['dtype']}",
        "",
    ]
    if peak:
        lines += [
            f"peak: {peak['flops_s'] / 1e9:.1f} GFLOP/s (median of {peak['reps']} {peak['dtype']} "
            f"{peak['size']}×{peak['size']} matrix products); % peak: a step's matrix-product FLOPs (forward + "
            "backward, 2 per multiply-add; softmax and elementwise work free) per second ÷ that peak",
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
            "| model | L | B | H | d_k | step ms | tokens/s | peak MB | SDPA | ÷ torch | ÷ scaled_dot | % peak |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in enc:
            lines.append(
                f"| {r['score']} | {r['length']} | {r['batch']} | {r['num_heads']} | {r['d_k']} | "
                f"{r['median_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['peak_mb']:.0f} | {r['sdpa_kernel']} | "
                f"{_fmt(r['ratio_torch'])} | {_fmt(r['ratio_scaled_dot'])} | {_pct(r.get('roofline'))} |"
            )
    variants = results.get("variants") or []
    if variants:
        lines += ["", *format_variants(variants)]
    blocks = results.get("blocks") or []
    if blocks:
        lines += [
            "",
            "| blocks (forward + backward) | L | B | step ms | peak MB | kernel | ÷ scaled_dot | ÷ naive additive "
            "| % peak |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in blocks:
            lines.append(
                f"| {r['variant']} | {r['length']} | {r['batch']} | {r['median_ms']:.1f} | {_fmt(r['peak_mb'], 0)} | "
                f"{r['sdpa_kernel']} | {_fmt(r['ratio_scaled_dot'])} | {_fmt(r['ratio_naive'])} | "
                f"{_pct(r.get('roofline'))} |"
            )
    tiled = results.get("tiled") or []
    if tiled:
        lines += [
            "",
            "| tiled kernel alone (forward + backward) | L | B | ms | ÷ sdpa |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in tiled:
            lines.append(
                f"| {r['variant']}: {r['impl']} | {r['length']} | {r['batch']} | {r['median_ms']:.1f} | "
                f"{_fmt(r['ratio_sdpa'])} |"
            )
    linear = results.get("linear") or []
    if linear:
        lines += ["", *format_linear(linear)]
    decode = results.get("decode") or []
    if decode:
        lines += ["", *format_decode(decode)]
    flex = results.get("flex") or []
    if flex:
        lines += ["", *format_flex(flex)]
    mha = results.get("mha") or []
    if mha:
        lines += ["", "| module | shape | step ms | ÷ torch |", "| --- | --- | --- | --- |"]
        for r in mha:
            shape = Shape(r["batch"], r["length"], r["d_model"], r["num_heads"], r["d_k"])
            lines.append(f"| {r['score']} | {shape.tag()} | {r['median_ms']:.2f} | {r['ratio_torch']:.2f} |")
    return "\n".join(lines)


def format_variants(rows: list[dict]) -> list[str]:
    """The variants table: per variant, whether it takes the fast path (with the SDPA kernel that ran when it was
    profiled) and the backend its first layer's training step runs, then per length its step ÷ scaled_dot and
    median step (ms), then per length its % of the machine's peak (matrix-product FLOPs, :func:`add_roofline`);
    the first line names the shapes."""
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
        "| variant | options | fast path | backend | "
        + " | ".join([*(f"÷ scaled_dot L={n} (ms)" for n in lengths), *(f"% peak L={n}" for n in lengths)])
        + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in range(2 * len(lengths))) + " |",
    ]
    for name in dict.fromkeys(r["variant"] for r in rows):
        first = next(r for r in rows if r["variant"] == name)
        cells = []
        for n in lengths:
            r = cell.get((name, n))
            text = "-" if r is None else f"{_fmt(r['ratio_scaled_dot'])} ({r['median_ms']:.1f})"
            if r is not None and r.get("ratio_causal") is not None:  # a causal variant: ÷ causal scaled_dot too
                text += f"; ÷ causal {_fmt(r['ratio_causal'])}"
            cells.append(text)
        cells += [_pct(cell[(name, n)].get("roofline")) if (name, n) in cell else "-" for n in lengths]
        fast = {True: "yes", False: "no", None: "-"}[first["fast_path"]]  # the backend column says which ran
        if first["fast_path"] and first["sdpa_kernel"]:
            fast += f" ({first['sdpa_kernel']})"
        backend = first.get("backend") or "-"
        lines.append(f"| {name} | {first['options']} | {fast} | {backend} | " + " | ".join(cells) + " |")
    return lines


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
        for row in [
            *results.get("encoder", []),
            *results.get("variants", []),
            *results.get("blocks", []),
            *results.get("tiled", []),
            *results.get("linear", []),
            *results.get("decode", []),
            *results.get("mha", []),
            *results.get("flex", []),
        ]:
            writer.writerow(_csv_row(row))
    with paths[2].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=TARGET_FIELDS)
        writer.writeheader()
        writer.writerows(_csv_row(row) for row in results["targets"])
    return paths


def _csv_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row whose text cells never start a spreadsheet formula (:func:`attnlab.runs.csv_safe`); numbers stay."""
    from attnlab.runs import csv_safe

    return {k: csv_safe(v) if isinstance(v, str) else v for k, v in row.items()}
