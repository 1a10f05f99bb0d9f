"""Tests for attnlab.dashboard on synthetic run folders written here (no training), and in headless Chromium."""

from __future__ import annotations

import csv
import html as html_lib
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import run_train

from attnlab import dashboard
from attnlab import stats as core_stats
from attnlab.dashboard import Sweep, aggregate, build_html, find_run_dirs, load_runs, main, mean_ci, t_critical
from attnlab.dashboard import metrics as metrics_module
from attnlab.dashboard.metrics import VIEWS, metrics_in, register_metric, show_metric
from attnlab.dashboard.stats import aggregate_lengths

EVIL = "<script>alert(1)</script>"
T975_DF1 = 12.706204736  # t_{0.975, 1}
T975_DF2 = 4.302652730  # t_{0.975, 2}
D_KS = (8, 64, 512)
LAYERS, HEADS = 2, 2


# ---------------------------------------------------------------------------------------------------- fixtures
def _png(width: int = 4, height: int = 3) -> bytes:
    """A tiny valid grey-gradient PNG, written by hand (no Pillow)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes((x * 60 + y * 20) % 256 for x in range(width)) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def acc_of(variant: str, d_k: int, seed: int) -> float:
    """The synthetic final test accuracy (dot degrades with d_k; seed 1 is 0.1 better than seed 0)."""
    base = 0.8 if variant != "dot" else 0.9 - 0.05 * math.log2(d_k) / 3
    return round(base + 0.1 * seed, 6)


def saturation(variant: str, d_k: int, step: int) -> float:
    """Synthetic saturation: grows with d_k for unscaled dot, flat for scaled dot."""
    grow = math.log2(d_k) / 9 if variant == "dot" else 0.05
    return round(min(1.0, grow * (1.0 if step == 0 else 1.2)), 6)


def _diag_row(variant: str, d_k: int, step: int) -> dict:
    sat = saturation(variant, d_k, step)
    ent = round(1.0 - sat, 6)
    row: dict = {"step": step}
    for layer in range(LAYERS):
        for head in range(HEADS):
            row[f"attn/L{layer}H{head}/entropy_norm"] = round(ent - 0.01 * (layer + head), 6)
            row[f"attn/L{layer}H{head}/saturation"] = round(sat + 0.01 * (layer + head), 6)
        row[f"attn/L{layer}/entropy_norm"] = ent
    row.update({"attn/entropy_norm": ent, "attn/saturation": sat, "attn/max_prob": 0.5 + sat / 2})
    row.update({"attn/logit_std": d_k**0.5, "attn/logit_max": 3 * d_k**0.5, "attn/entropy": None})
    return row


def write_run(
    folder: Path,
    variant: str,
    d_k: int | None,
    seed: int,
    status: str | None = "ok",
    reason: str | None = None,
    torn: bool = False,
    image: bool = False,
    num_heads: int = HEADS,
    task: str = "digits",
    datamodule: dict | None = None,
    lengths: dict[int, float] | None = None,
    normalizer: str | None = None,
    lr: float = 0.003,
    optimized: float | None = None,
    pos: str = "sinusoidal",
    max_steps: int = 100,
    extra: dict | None = None,
    overrides: list[str] | None = None,
    settings: dict | None = None,
    map_size: tuple[int, int] = (4, 3),
) -> Path:
    """One synthetic run folder; ``status=None`` leaves out summary.json (a crashed run). ``lengths`` ({L: acc})
    adds ``test/acc@L`` and ``test/loss@L`` (= 1 - acc) as a run with ``task.datamodule.test_lengths`` has them;
    ``datamodule`` is written under ``task.datamodule`` in config.yaml, ``extra`` as more top-level keys;
    ``overrides`` and ``settings`` go to summary.json; ``map_size`` is the saved attention maps' size."""
    folder.mkdir(parents=True)
    d_model = 64
    resolved = d_k if d_k is not None else d_model // num_heads
    config = (
        f"variant:\n  name: {json.dumps(variant)}\n  params: {{}}\nmask:\n  name: none\ntask:\n"
        f"  name: {json.dumps(task)}\n  datamodule: {json.dumps(datamodule or {})}\n"
        f"d_model: {d_model}\nd_k: {'null' if d_k is None else d_k}\nnum_heads: {num_heads}\nnum_layers: {LAYERS}\n"
        f"lr: {lr}\nbatch_size: 32\nmax_steps: {max_steps}\nseed: {seed}\nmodel:\n  pos_encoding: {pos}\n"
        f"normalizer:\n  name: {json.dumps(normalizer or 'softmax')}\n"
        + "".join(f"{key}: {json.dumps(value)}\n" for key, value in (extra or {}).items())
    )
    by_length = {}
    for length, value in (lengths or {}).items():
        by_length.update({f"test/acc@{length}": value, f"test/loss@{length}": round(1 - value, 6)})
    (folder / "config.yaml").write_text(config)
    acc = acc_of(variant, resolved, seed)
    rows = [_diag_row(variant, resolved, 0)]
    rows += [{"step": s, "train/loss": 2.3 - s / 60, "train/acc": min(1.0, s / 120)} for s in range(10, 101, 10)]
    rows += [{"step": 50, "val/loss": 1.5, "val/acc": acc - 0.1, "val/acc_best": acc - 0.1}]
    rows += [{"step": 100, "val/loss": 1.0, "val/acc": acc, "val/acc_best": acc}, _diag_row(variant, resolved, 100)]
    rows += [{"step": 100, "test/acc": acc, "test/loss": 0.9, **by_length}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if torn:
        text += '{"step": 110, "train/loss": 0.'  # a killed run's half-written last line
    (folder / "metrics.jsonl").write_text(text)
    if status is not None:
        summary = {
            "status": status,
            "reason": reason,
            "variant": variant,
            "mask": "none",
            "task": task,
            "d_k": resolved,
            "num_heads": num_heads,
            "d_model": d_model,
            "num_layers": LAYERS,
            "seed": seed,
            "lr": 0.003,
            "batch_size": 32,
            "max_steps": max_steps,
            "pos_encoding": pos,
            "variant_params": {},
            "params": 12345 + resolved,
            "wall_time_s": 12.5 + seed,
            "steps": 100,
            "chance_accuracy": 0.1,
        }
        if normalizer is not None:
            summary["normalizer"] = normalizer
        if overrides is not None:
            summary["overrides"] = overrides
        if settings is not None:
            summary["settings"] = settings
        if status == "ok":
            final = {k: v for k, v in _diag_row(variant, resolved, 100).items() if k.count("/") == 1}
            summary["metrics"] = {"val/acc_best": acc, "val/acc": acc, "test/acc": acc, "test/loss": 0.9, **final}
            summary["metrics"].update(by_length)
            if optimized is not None:
                summary["metrics"]["val/acc_best"] = optimized
            summary["attn_init"] = {k: v for k, v in _diag_row(variant, resolved, 0).items() if k.count("/") == 1}
        (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    if image:
        (folder / "attention_maps.png").write_bytes(_png(*map_size))
        (folder / "attention").mkdir()
        (folder / "attention" / "step_100.png").write_bytes(_png(2, 2))
    # things the search must not mistake for runs
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "config.yaml").write_text("variant: ${oc.env:NOPE}\n")
    (folder / "checkpoints").mkdir()
    return folder


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of two sweeps: 2 variants x 3 d_k x 2 seeds finished, plus a failed run, a run without summary
    (and a torn metrics line), and a finished run whose variant name is a script tag."""
    root = tmp_path_factory.mktemp("sweeps")
    job = 0
    for variant, sweep in (("dot", "sweep_a"), ("scaled_dot", "sweep_b")):
        (root / sweep).mkdir()
        (root / sweep / "multirun.yaml").write_text("hydra: {}\n")
        for d_k in D_KS:
            for seed in (0, 1):
                name = f"{job}_d_k={d_k},seed={seed},variant={variant}"
                write_run(root / sweep / name, variant, d_k, seed, image=(d_k == 8 and seed == 0))
                job += 1
    write_run(root / "sweep_b" / f"{job}_failed", "scaled_dot", 64, 2, status="failed", reason="NaN loss at step 37")
    write_run(root / "sweep_b" / f"{job + 1}_crashed", "dot", 512, 2, status=None, torn=True)
    write_run(root / "sweep_b" / f"{job + 2}_variant=evil<script>alert(2)", EVIL, 64, 0)
    wandb = root / "sweep_a" / "wandb" / "offline-run-1"
    wandb.mkdir(parents=True)
    (wandb / "config.yaml").write_text("wandb_version: 1\n")
    return root


@pytest.fixture(scope="module")
def page(sweeps: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("page") / "dashboard.html"
    assert main([str(sweeps), "-o", str(out)]) == 0
    return out


LENGTHS = (16, 64, 256)  # the shift task's test lengths (trained at 16): a factor of 16, so a log axis
LENGTH_BASE = {("scaled_dot", "softmax"): 0.9, ("alibi", "softmax"): 0.95, ("scaled_dot", "sparsemax"): 0.85}


def len_acc(variant: str, normalizer: str, length: int, seed: int) -> float:
    """Synthetic test/acc@L: 0.05 lower per doubling of L past 16, 0.05 higher per seed."""
    return round(LENGTH_BASE[variant, normalizer] - 0.05 * math.log2(length / 16) + 0.05 * seed, 6)


@pytest.fixture(scope="module")
def length_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Runs with test/acc@L: task shift (seq_len 16, L = 16, 64, 256): scaled_dot (2 seeds), alibi (3 seeds) and
    scaled_dot with normalizer sparsemax (2 seeds), a failed run and a run without length metrics (both left out of
    the chart); task reverse (seq_len 8, L = 8, 16): one seed of a variant named by a script tag."""
    root = tmp_path_factory.mktemp("lengths")
    shift = {"seq_len": 16, "test_lengths": list(LENGTHS)}
    job = 0
    for variant, normalizer, seeds in (
        ("scaled_dot", "softmax", 2),
        ("alibi", "softmax", 3),
        ("scaled_dot", "sparsemax", 2),
    ):
        for seed in range(seeds):
            acc = {n: len_acc(variant, normalizer, n, seed) for n in LENGTHS}
            write_run(root / f"{job}_{variant}_{normalizer}_{seed}", variant, 16, seed, task="shift", datamodule=shift,
                      lengths=acc, normalizer=normalizer)  # fmt: skip
            job += 1
    write_run(root / f"{job}_failed", "alibi", 16, 9, status="failed", reason="NaN", task="shift", datamodule=shift,
              lengths={16: 0.1, 64: 0.1, 256: 0.1}, normalizer="softmax")  # fmt: skip
    write_run(root / f"{job + 1}_no_lengths", "alibi", 16, 8, task="shift", datamodule={"seq_len": 16},
              normalizer="softmax")  # fmt: skip
    write_run(root / f"{job + 2}_evil", EVIL, 16, 0, task="reverse", datamodule={"seq_len": 8, "test_lengths": [8, 16]},
              lengths={8: 0.5, 16: 0.25}, normalizer="softmax")  # fmt: skip
    return root


@pytest.fixture(scope="module")
def length_page(length_sweep: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("length_page") / "dashboard.html"
    dashboard.write_dashboard(length_sweep, out)
    return out


MAP_SIZE = (768, 352)  # the size of a saved attention/maps.png (2 layers x 4 heads)


@pytest.fixture(scope="module")
def folder_of_sweeps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of two sweeps as a smoke sweep beside a longer one leaves them, 20 runs of 4 heads, 2 seeds each:
    ``smoke`` (max_steps 5, eval_every 5, 32 test examples): variant=rope (a preset: its config holds scaled_dot
    and pos_encoding rope), variant=alibi (pos_encoding none) and scaled_dot at d_k 8 and 512, num_kv_heads left
    null; ``full`` (max_steps 100, eval_every 50, 64 test examples): scaled_dot and dot with d_k left null (64 // 4
    = 16) and num_kv_heads 1 and 2. Seed 0 of each smoke configuration saved a 768 x 352 attention map."""
    root = tmp_path_factory.mktemp("folder")
    job = 0
    for sweep, variants, d_ks, kv_heads, steps, every, tests in (
        ("smoke", (("rope", "scaled_dot", "rope"), ("alibi", "alibi", "none"), ("scaled_dot", "scaled_dot",
         "sinusoidal")), (8, 512), (None,), 5, 5, 32),
        ("full", (("scaled_dot", "scaled_dot", "sinusoidal"), ("dot", "dot", "sinusoidal")), (None,), (1, 2), 100,
         50, 64),
    ):  # fmt: skip
        for asked, name, pos in variants:
            for d_k in d_ks:
                for kv in kv_heads:
                    for seed in (0, 1):
                        overrides = [f"variant={asked}", f"seed={seed}"] + ([f"d_k={d_k}"] if d_k else [])
                        overrides += [f"num_kv_heads={kv}"] if kv else ["debug=fast"]
                        write_run(root / sweep / f"{job}_{asked}_{d_k}_{kv}_{seed}", name, d_k, seed, num_heads=4,
                                  pos=pos, max_steps=steps, extra={"eval_every": every, "num_kv_heads": kv},
                                  datamodule={"num_test": tests}, overrides=overrides,
                                  settings={"num_kv_heads": kv, "d_k": d_k}, image=sweep == "smoke" and seed == 0,
                                  map_size=MAP_SIZE)  # fmt: skip
                        job += 1
    return root


@pytest.fixture(scope="module")
def folder_page(folder_of_sweeps: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dashboard.write_dashboard(folder_of_sweeps, tmp_path_factory.mktemp("folder_page") / "dashboard.html")


# ---------------------------------------------------------------------------------------------------- statistics
def test_t_critical_is_scipys_quantile() -> None:
    assert t_critical(1) == pytest.approx(T975_DF1, abs=1e-9)
    assert t_critical(2) == pytest.approx(T975_DF2, abs=1e-9)
    with pytest.raises(ValueError):
        t_critical(0)


def test_mean_ci_by_hand() -> None:
    mean, half, n = mean_ci([0.5, 0.7, 0.9, None, float("nan")])
    # mean 0.7, s = 0.2, half = t_{0.975,2} * 0.2 / sqrt(3)
    assert (n, mean) == (3, pytest.approx(0.7))
    assert half == pytest.approx(T975_DF2 * 0.2 / math.sqrt(3), rel=1e-6)
    assert mean_ci([0.4]) == (0.4, None, 1)
    mean, half, n = mean_ci([])
    assert math.isnan(mean) and half is None and n == 0


# ---------------------------------------------------------------------------------------------------- loading
def test_find_run_dirs_skips_hydra_wandb_and_checkpoints(sweeps: Path) -> None:
    names = [p.relative_to(sweeps).as_posix() for p in find_run_dirs(sweeps)]
    assert len(names) == 15
    assert not any(part in name for name in names for part in (".hydra", "wandb", "checkpoints"))
    # natural order inside a sweep: 2_... before 10_...
    assert names[:2] == ["sweep_a/0_d_k=8,seed=0,variant=dot", "sweep_a/1_d_k=8,seed=1,variant=dot"]
    one = find_run_dirs(sweeps / "sweep_a" / "0_d_k=8,seed=0,variant=dot")
    assert one == [sweeps / "sweep_a" / "0_d_k=8,seed=0,variant=dot"]


def test_load_runs_statuses_fallbacks_and_torn_line(sweeps: Path) -> None:
    runs = {r.name.split("/")[-1]: r for r in load_runs(sweeps)}
    failed, crashed = runs["12_failed"], runs["13_crashed"]
    assert (failed.status, failed.reason, failed.ok) == ("failed", "NaN loss at step 37", False)
    assert crashed.status == "failed (no summary)" and crashed.summary is None and "summary.json" in crashed.reason
    # config-only run: fields from config.yaml, metrics from the last complete metrics.jsonl rows
    assert (crashed.variant, crashed.d_k, crashed.num_heads, crashed.seed) == ("dot", 512, HEADS, 2)
    # the last complete row ({"step": 100, "test/acc": ..., "test/loss": 0.9}) is read, the torn one after it is not
    assert crashed.metric_log.row_count == 15
    assert [c[0].tolist()[-1:] for c in map(crashed.curve, ("test/acc", "test/loss"))] == [[100.0], [100.0]]
    assert (crashed.final("test/loss"), crashed.final("train/loss")) == (0.9, 2.3 - 100 / 60)
    assert crashed.final("test/acc") == acc_of("dot", 512, 2)
    assert crashed.init("attn/saturation") == saturation("dot", 512, 0)  # from the step-0 row
    ok = runs["5_d_k=512,seed=1,variant=dot"]
    assert ok.init("attn/saturation") == saturation("dot", 512, 0)  # from summary attn_init
    assert ok.final("attn/entropy") is None  # null everywhere
    steps, values = ok.curve("attn/saturation")
    assert steps.tolist() == [0.0, 100.0]
    assert values.tolist() == [saturation("dot", 512, 0), saturation("dot", 512, 100)]
    grid = ok.head_grid("saturation")
    assert grid is not None and grid.shape == (LAYERS, HEADS)
    assert grid[1, 1] == pytest.approx(saturation("dot", 512, 100) + 0.02)
    assert ok.images() == []
    assert [p.name for p in runs["0_d_k=8,seed=0,variant=dot"].images()] == ["attention_maps.png", "step_100.png"]


def test_d_k_null_resolves_and_pools_a_heads_sweep(tmp_path: Path) -> None:
    for i, (heads, seed) in enumerate([(1, 0), (1, 1), (4, 0), (4, 1)]):
        write_run(tmp_path / f"{i}_h={heads}", "dot", None, seed, num_heads=heads)
    runs = load_runs(tmp_path)
    assert [r.d_k for r in runs] == [64, 64, 16, 16]
    sweep = Sweep(runs)  # d_k is null in every config: a constant, so the heads are the only dimension
    assert [d.name for d in sweep.dims] == ["heads"] and sweep.constants["d_k"] is None
    (series,) = aggregate(runs, sweep, "test/acc", sweep.dim("heads"), [])
    assert series.label == "all runs" and [p.x for p in series.points] == [1.0, 4.0]
    assert [p.n for p in series.points] == [2, 2]


def test_partial_runs_still_make_a_page(tmp_path: Path) -> None:
    """A still-running run and a config-only run (plain-string variant, no metrics.jsonl, no summary)."""
    write_run(tmp_path / "0_running", "alibi", 16, 0, status="running")
    old = tmp_path / "1_old"
    old.mkdir()
    (old / "config.yaml").write_text("variant: additive\nd_model: 32\nd_k: null\nnum_heads: 4\nseed: 3\n")
    running, config_only = load_runs(tmp_path)
    assert (running.status, running.ok, running.final("test/acc")) == ("running", False, acc_of("alibi", 16, 0))
    assert (config_only.variant, config_only.d_k, config_only.seed) == ("additive", 8, 3)
    assert config_only.metric_log.row_count == 0 and config_only.metric_names == frozenset()
    assert config_only.final("test/acc") is None and config_only.head_grid("saturation") is None
    html = build_html([running, config_only])
    assert '<tr class="running"' in html and '<tr class="failed"' in html
    assert "No finished run reports a metric yet." in html and 'id="final"' not in html
    assert 'id="curves"' in html and 'id="heads-' in html  # the running run's rows and per-head values show


# ---------------------------------------------------------------------------------------------------- aggregation
def test_aggregate_mean_and_ci_by_hand(sweeps: Path) -> None:
    runs = load_runs(sweeps)
    sweep = Sweep(runs)
    assert [d.name for d in sweep.dims] == ["variant", "d_k"]
    x = sweep.dim("d_k")
    by_label = {s.label: s for s in aggregate(runs, sweep, "test/acc", x, sweep.series_dims(x))}
    assert set(by_label) == {"dot", "scaled_dot", EVIL}
    point = next(p for p in by_label["dot"].points if p.x == 64)
    a, b = acc_of("dot", 64, 0), acc_of("dot", 64, 1)  # 0.8 and 0.9: seeds 0, 1; the no-summary run is out
    assert point.n == 2 and sorted(point.values) == [a, b]
    assert point.mean == pytest.approx((a + b) / 2, abs=1e-12)
    # s = |a - b| / sqrt(2), half-width = t_{0.975,1} * s / sqrt(2) = 12.706 * |a - b| / 2
    assert point.half_width == pytest.approx(T975_DF1 * abs(a - b) / 2, rel=1e-6)
    assert point.half_width == pytest.approx(0.6353102368, rel=1e-6)
    # the failed scaled_dot run (seed 2) does not enter the d_k = 64 point
    assert next(p for p in by_label["scaled_dot"].points if p.x == 64).n == 2
    evil = by_label[EVIL].points
    assert len(evil) == 1 and evil[0].half_width is None  # one seed: no interval
    init = aggregate(runs, sweep, "attn/saturation", x, sweep.series_dims(x), value=lambda r, m: r.init(m))
    dot = next(s for s in init if s.label == "dot")
    assert [p.mean for p in dot.points] == pytest.approx([saturation("dot", d, 0) for d in D_KS])


def test_aggregate_lengths_by_hand(length_sweep: Path, sweeps: Path, tmp_path: Path) -> None:
    runs = load_runs(length_sweep)
    sweep = Sweep(runs)
    # the normalizer varies, so it names the lines; the test lengths (the x axis) are no dimension; the task
    # follows the variant here (only the script-tag variant runs reverse), so it is no dimension of its own
    assert [d.name for d in sweep.dims] == ["variant", "normalizer"] and sweep.derived == {"task.name": "variant.name"}
    series_dims = sweep.dims
    shift_runs = [r for r in runs if r.task == "shift"]
    shift = {s.label: s for s in aggregate_lengths(shift_runs, sweep, "test/acc", series_dims)}
    # the failed run and the run without test/acc@L are left out
    assert list(shift) == [
        "alibi · normalizer=softmax",
        "scaled_dot · normalizer=softmax",
        "scaled_dot · normalizer=sparsemax",
    ]
    assert all([p.x for p in s.points] == [16.0, 64.0, 256.0] for s in shift.values())
    # alibi at L = 64, seeds 0, 1, 2: 0.85, 0.90, 0.95 -> mean 0.90, s = 0.05, half = t_{0.975,2} * 0.05 / sqrt(3)
    point = shift["alibi · normalizer=softmax"].points[1]
    assert point.n == 3 and sorted(point.values) == pytest.approx([0.85, 0.9, 0.95])
    assert point.mean == pytest.approx(0.9, abs=1e-12)
    assert point.half_width == pytest.approx(T975_DF2 * 0.05 / math.sqrt(3), rel=1e-6)
    assert point.half_width == pytest.approx(0.1242068, rel=1e-6)
    # scaled_dot/softmax at L = 256, seeds 0, 1: 0.70, 0.75 -> mean 0.725, half = t_{0.975,1} * 0.05 / 2
    point = shift["scaled_dot · normalizer=softmax"].points[2]
    assert (point.n, point.mean) == (2, pytest.approx(0.725, abs=1e-12))
    assert point.half_width == pytest.approx(T975_DF1 * 0.05 / 2, rel=1e-6)
    assert [p.mean for p in shift["scaled_dot · normalizer=sparsemax"].points] == pytest.approx([0.875, 0.775, 0.675])
    (evil,) = aggregate_lengths([r for r in runs if r.task == "reverse"], sweep, "test/acc", series_dims)
    assert evil.label == f"{EVIL} · normalizer=softmax"
    assert [(p.x, p.mean, p.half_width, p.n) for p in evil.points] == [(8.0, 0.5, None, 1), (16.0, 0.25, None, 1)]
    (loss,) = aggregate_lengths([r for r in runs if r.task == "reverse"], sweep, "test/loss", series_dims)
    assert [p.mean for p in loss.points] == pytest.approx([0.5, 0.75])
    assert aggregate_lengths(runs, sweep, "test/bpc", series_dims) == []
    other = load_runs(sweeps)
    assert aggregate_lengths(other, Sweep(other), "test/acc", []) == []
    # the training length: seq_len, else max_length, else associative recall's own (pairs + queries)
    assert {r.task: r.train_length for r in runs} == {"shift": 16, "reverse": 8}
    for i, (task, datamodule, expected) in enumerate(
        [
            ("listops", {"max_length": 64}, 64),
            ("associative_recall", {"num_pairs": 2, "num_queries": None, "seq_len": None, "fused_pairs": True}, 4),
            ("associative_recall", {"num_pairs": 8, "num_queries": 4, "seq_len": None, "fused_pairs": False}, 20),
            ("digits", {}, None),
        ]
    ):
        write_run(tmp_path / str(i), "dot", 8, 0, task=task, datamodule=datamodule)
        assert dashboard.load_run(tmp_path / str(i)).train_length == expected, task
    # CSV: one column per metric and length, after the others; empty where a run has no such value
    out = dashboard.write_csv(runs, tmp_path / "lengths.csv")
    header = next(csv.reader(out.open()))
    assert header[-8:] == [f"{m}@{n}" for m in ("test/acc", "test/loss") for n in (8, 16, 64, 256)]
    rows = {r["run"]: r for r in csv.DictReader(out.open())}
    assert float(rows["0_scaled_dot_softmax_0"]["test/acc@256"]) == pytest.approx(0.7)
    assert rows["0_scaled_dot_softmax_0"]["test/acc@8"] == "" and rows["8_no_lengths"]["test/acc@64"] == ""
    assert float(rows["9_evil"]["test/loss@16"]) == pytest.approx(0.75)
    assert rows["1_scaled_dot_softmax_1"]["normalizer.name"] == "softmax"  # every varying key is a column


# ---------------------------------------------------------------------------------------------------- the page
def _figure_json(html: str, div_id: str) -> dict:
    """The plotly figure stored in the page for the div ``div_id``."""
    match = re.search(rf'<script type="application/json" id="{re.escape(div_id)}-json">(.*?)</script>', html, re.S)
    assert match is not None, div_id
    return json.loads(match.group(1))


def test_page_is_self_contained_escaped_and_lists_every_run(page: Path, sweeps: Path, capsys) -> None:
    html = page.read_text()
    from plotly.offline import get_plotlyjs

    plotly_js = get_plotlyjs()
    assert html.count(plotly_js[:200]) == 1 and plotly_js in html  # plotly.js inline, exactly once
    assert html.count("<script src") == 0 and 'src="http' not in html and "<link" not in html
    assert "cdn.plot.ly/plotly" not in html and "cdn.jsdelivr" not in html.replace(plotly_js, "")
    assert "Content-Security-Policy" in html
    # escaping: the script-tag variant and folder name never appear raw, in the HTML or in the figures' JSON
    assert "<script>alert" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "evil&lt;script&gt;alert(2)" in html
    # runs table: every run, the failed ones marked with the reason as tooltip; status and time up front
    table = html[html.index('<table class="runs sortable"') : html.index("</table>", html.index('class="runs'))]
    rows = re.findall(r"<tr class=\"(\w+)\">", table)
    assert len(rows) == 15
    assert rows.count("failed") == 2 and rows.count("ok") == 13
    assert 'title="NaN loss at step 37"' in table and "failed (no summary)" in table
    headers = re.findall(r'data-key="([^"]+)"', table)
    # (the headline metric that digits declares, test/acc, first)
    assert headers == ["run", "status", "wall time", "variant", "d_k", "seed", "params", "state", "test/acc",
                       "val/acc_best", "attn/entropy_norm", "attn/saturation"]  # fmt: skip
    # sections: the headline first, then the charts; no length chart (no run has test/acc@L)
    sections = re.findall(r'<section id="([\w-]+)">', html)
    assert sections == ["headline", "final", "init", "curves", "heads", "atlas", "maps", "runs"]
    # one heatmap per variant with per-head values, and one attention map per variant that saved one
    assert len(re.findall(r'<select data-choices="heads-\d+-choices"', html)) == 3
    assert len(re.findall(r'<img id="map-\d+" src="data:image/png;base64,', html)) == 2
    # the final-metrics figure: a chance line on accuracy panels, intervals clipped to [0, 1] for accuracy
    fig = _figure_json(html, "fig-1")
    assert any(shape.get("y0") == 0.1 and shape["line"]["dash"] == "dash" for shape in fig["layout"]["shapes"])
    for trace in fig["data"]:
        if trace["yaxis"] == "y":  # the first panel: val/acc_best
            for mean, up, down in zip(
                trace["y"], trace["error_y"]["array"], trace["error_y"]["arrayminus"], strict=True
            ):
                assert up is None or mean + up <= 1 + 1e-12
                assert down is None or mean - down >= -1e-12


def test_headline_names_the_winner_by_hand(sweeps: Path) -> None:
    """test/acc (the headline digits declares; val/acc_best is the same here) per variant x d_k, by hand: dot at
    d_k = 8 is 0.9 and 1.0 (mean 0.95), everything else lower."""
    html = build_html(load_runs(sweeps))
    section = html[html.index('<section id="headline">') : html.index("</section>", html.index('id="headline"'))]
    verdict = html_lib.unescape(re.search(r'<p class="verdict">(.*?)</p>', section).group(1))
    means = {}
    for variant in ("dot", "scaled_dot"):
        for d_k in D_KS:
            values = [acc_of(variant, d_k, seed) for seed in (0, 1)]
            means[variant, d_k] = sum(values) / 2
    (best_variant, best_d_k), best = max(means.items(), key=lambda kv: kv[1])
    assert verdict.startswith(f"Best test/acc: {best_variant} at d_k={best_d_k}, {100 * best:.1f} %")
    runner = max((v for (variant, d_k), v in means.items() if d_k == best_d_k and variant != best_variant))
    assert f"{100 * (best - runner):.1f} points behind" in verdict
    table = section[section.index('<table class="headline"') :]
    assert table.count('class="best"') >= 3  # one per d_k column at least (ties all marked)
    assert "<th>d_k=8</th><th>d_k=64</th><th>d_k=512</th>" in table


def _page_figures(html: str) -> list[tuple[str, dict]]:
    """Every plotly figure the page stores: those drawn at load and every choice of a selector."""
    out = []
    for match in re.finditer(r'<script type="application/json" id="([\w-]+)">(.*?)</script>', html, re.S):
        value = json.loads(match.group(2))
        if isinstance(value, dict) and "data" in value:
            out.append((match.group(1), value))
        elif isinstance(value, dict):
            out += [(f"{match.group(1)}[{k}]", v) for k, v in value.items() if isinstance(v, dict) and "data" in v]
    return out


def _draws_markers(trace: dict) -> bool:
    """Whether plotly draws markers for ``trace``: a scatter whose mode names them, or that names no mode (then
    plotly draws them on a trace of fewer than 20 points)."""
    mode = trace.get("mode")
    return trace.get("type", "scatter") in ("scatter", "scattergl") and (mode is None or "markers" in mode)


def _stray_markers(fig: dict) -> list[str]:
    """The traces that draw markers without a legend entry of their own or a legended twin (the same legend group,
    name and mode: a line's copy in another panel, as the error-bar points of a series); a seed band, say."""
    twin = {
        (t.get("legendgroup"), t.get("name"), t.get("mode"))
        for t in fig["data"]
        if t.get("showlegend", True) is not False and _draws_markers(t) and t.get("legendgroup")
    }
    return [
        f"{t.get('name')} (fill {t.get('fill')}, mode {t.get('mode')})"
        for t in fig["data"]
        if _draws_markers(t)
        and t.get("showlegend", True) is False
        and (t.get("legendgroup"), t.get("name"), t.get("mode")) not in twin
    ]


def test_no_trace_draws_markers_without_a_legend_entry(
    page: Path, length_page: Path, folder_page: Path, tmp_path: Path
) -> None:
    """The seed bands of the training curves (``fill: toself``, no mode) drew stray dots on curves of fewer than 20
    points. In every figure of four pages (a sweep, lengths, a folder of sweeps, a search): a trace that draws
    markers is in the legend or is a panel's copy of a legended one (same group, name and mode); bands draw lines
    of width 0."""
    for i, lr in enumerate((1e-4, 3e-4, 1e-3, 3e-3, 1e-2)):
        write_run(tmp_path / "search" / f"{i}_trial", "scaled_dot", 8, 0, lr=lr, optimized=0.5 + i / 20)
    pages = [p.read_text() for p in (page, length_page, folder_page)] + [build_html(load_runs(tmp_path / "search"))]
    assert '<section id="search">' in pages[-1]
    bands = 0
    for html in pages:
        figs = _page_figures(html)
        assert len(figs) >= 2
        for name, fig in figs:
            assert _stray_markers(fig) == [], name
            for trace in fig["data"]:
                if trace.get("fill") == "toself":
                    bands += 1
                    assert trace["mode"] == "lines" and trace["line"]["width"] == 0, name
    assert bands >= 10  # (the curves of val/acc, entropy_norm, saturation: 2 to 4 points each)


def test_a_folder_of_sweeps_labels_the_asked_variant_with_resolved_values_and_no_knobs(
    folder_of_sweeps: Path, folder_page: Path
) -> None:
    """variant=rope is "rope" (not "scaled_dot · pos=rope" beside "alibi · pos=none"), d_k and kv_heads left null
    show the values the runs used (16, 4), and the run knobs that differ between the sweeps (max_steps,
    eval_every, num_test) stay out of every label (the runs table keeps them); each headline cell names its runs'
    parameter count."""
    runs = load_runs(folder_of_sweeps)
    sweep = Sweep(runs)
    assert [d.name for d in sweep.dims[:3]] == ["variant", "d_k", "kv_heads"]
    assert sorted(d.name for d in sweep.knobs) == ["eval_every", "max_steps", "num_test"]
    assert sweep.dim("variant").values == ("alibi", "dot", "rope", "scaled_dot")
    assert sweep.dim("d_k").values == (8, 16, 512) and sweep.dim("kv_heads").values == (1, 2, 4)
    html = folder_page.read_text()
    names = {t["name"] for _, fig in _page_figures(html) for t in fig["data"] if t.get("type") != "heatmap"}
    section = html[html.index('<section id="headline">') : html.index("</section>", html.index('id="headline"'))]
    first = section[section.index('<table class="headline"') : section.index("</table>")]
    rows = [html_lib.unescape(r) for r in re.findall(r'<tr><td class="t">([^<]*)</td>', first)]
    assert rows == ["alibi · kv_heads=4", "dot · kv_heads=1", "dot · kv_heads=2", "rope · kv_heads=4",
                    "scaled_dot · kv_heads=1", "scaled_dot · kv_heads=2", "scaled_dot · kv_heads=4"]  # fmt: skip
    assert {"rope", "alibi", "dot", "scaled_dot"} <= names
    for label in names | set(rows):
        for bad in ("pos=", "null", "max_steps", "eval_every", "num_test"):
            assert bad not in label, label
    assert "<th>d_k=8</th><th>d_k=16</th><th>d_k=512</th>" in section
    header = html_lib.unescape(re.sub(r"<[^>]+>", "", html[: html.index("<nav>")]))
    assert "left out of labels" in header and "max_steps (2) · eval_every (2) · num_test (2)" in header
    table = html[html.index('<table class="runs sortable"') :]
    assert {"max_steps", "eval_every", "num_test"} <= set(re.findall(r'data-key="([^"]+)"', table))
    # parameters per cell (12345 + d_k in these runs), not a range over the row
    rope = re.search(r'<tr><td class="t">rope · kv_heads=4</td>(.*?)</tr>', first).group(1)
    assert re.findall(r'<span class="p">([^<]*)</span>', rope) == ["12,353 params", "12,857 params"]
    assert "–" not in first.split("</caption>")[1]  # no range: each cell's seeds have one count


def test_a_folder_of_sweeps_terminal_table_keeps_its_key_columns_whole(folder_of_sweeps: Path, capsys) -> None:
    """At 120 columns (and at 60) the table keeps the variant column and every value whole ("512", not "5…"); the
    run knobs are one column naming each distinct set, spelled out under the table."""
    import io

    from attnlab.console import plain_console

    runs = load_runs(folder_of_sweeps)
    dashboard.print_table(runs)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= 120 for line in lines), max(map(len, lines))
    header = next(line.split() for line in lines if "variant" in line)
    assert header[:4] == ["variant", "d_k", "kv_heads", "seed"] and header[-1] == "knobs"
    rows = [line.split() for line in lines if line.split()[:1] in (["rope"], ["alibi"], ["dot"], ["scaled_dot"])]
    assert len(rows) == 20 and "…" not in out
    assert sorted({r[1] for r in rows}, key=int) == ["8", "16", "512"] and {r[2] for r in rows} == {"1", "2", "4"}
    assert {r[-1] for r in rows if r[0] == "rope"} == {"k2"}  # (sweep "full" comes first)
    assert "k1: max_steps=100 · eval_every=50 · num_test=64" in out
    assert "k2: max_steps=5 · eval_every=5 · num_test=32" in out
    narrow = io.StringIO()
    dashboard.print_table(runs, console=plain_console(narrow, width=60))
    text = narrow.getvalue()
    assert "…" not in text and "scaled_dot" in text and " 512 " in text and "kv_heads" in text


def test_length_section_escaped_with_training_length(length_page: Path) -> None:
    html = length_page.read_text()
    section = html[html.index('<section id="lengths">') : html.index("</section>", html.index('id="lengths"'))]
    assert "<h2>Length generalisation</h2>" in section and 'id="fig-lengths"' in section
    assert 'href="#lengths"' in html and "the dashed vertical line marks the training length" in section
    # the variant's name reaches the figure's JSON as plain text, its angle brackets as look-alikes
    fig = _figure_json(html, "fig-lengths")
    assert "<script>alert" not in html
    assert "\u2039script\u203aalert(1)\u2039/script\u203a · normalizer=softmax" in {t["name"] for t in fig["data"]}
    notes = {a["text"] for a in fig["layout"]["annotations"]}
    assert "train L=16" in notes and "train L=8" in notes


def test_an_optuna_like_search_gets_a_search_view_with_the_best_run(tmp_path: Path) -> None:
    """Six trials, each with its own lr (and d_k from a choice): the search view plots val/acc_best against lr
    and d_k, one point per run, and stars and names the best trial."""
    trials = [(1e-4, 8, 0.30), (3e-4, 16, 0.55), (1e-3, 8, 0.80), (2e-3, 32, 0.72), (5e-3, 16, 0.61), (1e-2, 8, 0.2)]
    for i, (lr, d_k, acc) in enumerate(trials):
        write_run(tmp_path / f"{i}_trial", "scaled_dot", d_k, 0, lr=lr, optimized=acc)
    html = build_html(load_runs(tmp_path))
    assert '<section id="search">' in html
    section = html[html.index('<section id="search">') : html.index("</section>", html.index('id="search"'))]
    assert "Best run: 2_trial (d_k=8, lr=0.001): val/acc_best = 80.0 %." in html_lib.unescape(section)
    fig = _figure_json(html, re.search(r'id="(fig-\d+)"', section).group(1))
    points = [t for t in fig["data"] if t["name"] == "runs"]
    stars = [t for t in fig["data"] if t["name"] == "best run"]
    assert len(points) == len(stars) == 2  # one panel per searched key: d_k and lr
    by_panel = {t["xaxis"]: t for t in points}
    assert sorted(zip(by_panel["x2"]["x"], by_panel["x2"]["y"], strict=True)) == sorted((lr, a) for lr, _, a in trials)
    assert [(s["x"], s["y"]) for s in stars] == [([8.0], [0.8]), ([0.001], [0.8])]


def test_page_size_is_plotly_plus_a_little(page: Path) -> None:
    from plotly.offline import get_plotlyjs

    extra = page.stat().st_size - len(get_plotlyjs().encode())
    assert 0 < extra < 600_000, extra


def test_cli_default_output_and_bad_paths(sweeps: Path, tmp_path: Path, capsys) -> None:
    single = sweeps / "sweep_a" / "0_d_k=8,seed=0,variant=dot"
    copy = tmp_path / "one_run"
    shutil.copytree(single, copy)
    assert main([str(copy)]) == 0
    assert (copy / "dashboard.html").is_file()
    out = capsys.readouterr().out
    assert "attnlab · 1 runs" in out and "85.0 %" in out and f"wrote {copy / 'dashboard.html'}" in out
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        assert main([str(bad)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and str(bad) in err
    with pytest.raises(ValueError):
        dashboard.write_dashboard(tmp_path / "empty")
    with pytest.raises(ValueError):
        build_html([])


def test_a_corrupt_summary_costs_one_warning_and_the_other_runs_still_show(sweeps: Path, tmp_path: Path, capsys):
    for name in ("0_d_k=8,seed=0,variant=dot", "1_d_k=8,seed=1,variant=dot", "2_d_k=64,seed=0,variant=dot"):
        shutil.copytree(sweeps / "sweep_a" / name, tmp_path / name)
    (tmp_path / "1_d_k=8,seed=1,variant=dot" / "summary.json").write_text('{"status": "ok", "metr')
    assert main([str(tmp_path), "--csv", str(tmp_path / "runs.csv")]) == 0
    captured = capsys.readouterr()
    (warning,) = captured.err.strip().splitlines()
    assert warning.startswith("attnlab-dashboard: warning: run 1_d_k=8,seed=1,variant=dot: ")
    assert "summary.json is not valid JSON" in warning
    assert captured.out.count(" ok ") == 2 and "failed" in captured.out  # the other two, and the bad one as failed
    rows = list(csv.DictReader((tmp_path / "runs.csv").open()))
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    assert (tmp_path / "dashboard.html").stat().st_size > 0


def test_terminal_table_lists_every_run_untruncated(sweeps: Path, capsys) -> None:
    dashboard.print_table(load_runs(sweeps))
    out = capsys.readouterr().out
    assert "failed (no summary)" in out and "scaled_dot" in out and "<script>alert(1)</script>" in out
    assert out.count(" ok ") == 13 and "100.0 %" in out and "0.940" in out


@pytest.mark.slow
def test_python_m_entry_point_exit_code_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab.dashboard", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "no runs" in proc.stderr
    assert not (tmp_path / "dashboard.html").exists()


# ---------------------------------------------------------------------------------------------------- browser
REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("ATTNLAB_TEST_ARTIFACTS", REPO / "test-artifacts"))  # screenshots (git-ignored)


def _screenshot(page: Path, out: Path, tmp_path: Path, width: int = 1400, height: int = 2400) -> Path:
    """A PNG of the top ``height`` px of ``page`` at a ``width`` px window, taken by headless Chromium."""
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium not installed: apt-get install chromium")
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         f"--user-data-dir={tmp_path / 'shot-profile'}", "--virtual-time-budget=10000",
         f"--window-size={width},{height}", f"--screenshot={out}", page.as_uri()],
        capture_output=True, text=True, timeout=90, check=True,
    )  # fmt: skip
    return out


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _render(html: str, script: str, tmp_path: Path, width: int = 1400) -> tuple[subprocess.CompletedProcess, float]:
    """Open ``html`` with ``script`` added at the end of the body in headless Chromium; (its process with the final
    DOM as stdout and the console on stderr, seconds taken). Asserts that the page loaded without a JS error, a CSP
    violation or an "Uncaught" on the console."""
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium not installed: apt-get install chromium")
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", f"<script>{script}</script></body>"))
    started = time.perf_counter()
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=10000",
            f"--window-size={width},1000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    elapsed = time.perf_counter() - started
    dom = proc.stdout
    assert proc.returncode == 0 and "</html>" in dom, proc.stderr[-2000:]
    # no JS error, no CSP violation (the page's own window.onerror sink) and no "Uncaught" on the console
    errors = re.search(r'<div id="js-errors">(.*?)</div>', dom, re.S)
    assert errors is not None and errors.group(1).strip() == "", errors.group(1) if errors else dom[:500]
    assert "Uncaught" not in proc.stderr, proc.stderr[-2000:]
    assert "Content Security Policy" not in proc.stderr, proc.stderr[-2000:]
    return proc, elapsed


PROBE = """window.addEventListener('load', function () {
  var out = {figures: [], legend: [], labels: [], verdicts: [], tables: []};
  document.querySelectorAll('div.plot').forEach(function (div) {
    var L = div._fullLayout || {}, widths = [];
    Object.keys(L).filter(function (k) { return /^xaxis\\d*$/.test(k) && L[k].visible !== false; })
      .forEach(function (k) { widths.push(L[k]._length); });
    out.figures.push({id: div.id, svg: !!div.querySelector('svg.main-svg'), traces: (div.data || []).length,
      widths: widths, names: (div.data || []).map(function (t) { return t.name; }),
      types: Object.keys(L).filter(function (k) { return /^xaxis\\d*$/.test(k); }).sort()
        .map(function (k) { return L[k].type; }),
      shapes: (L.shapes || []).length});
  });
  document.querySelectorAll('.legendtext').forEach(function (n) { out.legend.push(n.textContent); });
  document.querySelectorAll('.annotation-text, .g-xtitle, .g-ytitle, .xtick, .ytick').forEach(function (n) {
    out.labels.push(n.textContent); });
  document.querySelectorAll('p.verdict').forEach(function (n) { out.verdicts.push(n.textContent); });
  document.querySelectorAll('table').forEach(function (t) {
    var r = t.getBoundingClientRect(), box = t.parentElement;
    out.tables.push({cls: t.className, right: r.right, text: t.textContent, width: t.scrollWidth,
      room: box.clientWidth, overflow: getComputedStyle(box).overflowX}); });
  out.maps = Array.prototype.map.call(document.querySelectorAll('.maps img'), function (img) {
    var r = img.getBoundingClientRect(); return {width: r.width, top: r.top}; });
  out.viewport = window.innerWidth;
  out.page_width = document.documentElement.scrollWidth;
  document.body.setAttribute('data-probe', JSON.stringify(out));
});"""


def _probe(html: str, tmp_path: Path, width: int = 1400) -> tuple[dict, str]:
    """Render the page in Chromium at ``width`` px and read back what :data:`PROBE` collects (figures with their
    panel widths, legend and label texts, verdicts, tables), with the final DOM."""
    proc, elapsed = _render(html, PROBE, tmp_path, width=width)
    probe = re.search(r'<body[^>]*data-probe="([^"]*)"', proc.stdout)
    assert probe is not None, proc.stdout[-2000:]
    assert elapsed < 60
    return json.loads(html_lib.unescape(probe.group(1))), proc.stdout


@pytest.mark.slow
def test_page_renders_in_headless_chromium(page: Path, tmp_path: Path) -> None:
    """Open the page in a real browser: every figure gets its SVG, no JS error, and the table sorts."""
    html = page.read_text()
    got, _ = _probe(html, tmp_path)
    assert len(got["figures"]) == len(re.findall(r'<div class="plot"', html)) >= 6
    assert all(f["svg"] and f["traces"] > 0 for f in got["figures"]), got["figures"]
    # the script-tag variant shows as text in the legend, never runs (errors would be in #js-errors)
    assert "\u2039script\u203aalert(1)\u2039/script\u203a" in got["legend"]
    click = """window.addEventListener('load', function () {
      var th = document.querySelector('#runs-table th[data-key="d_k"]'); th.click();
      var values = Array.prototype.map.call(document.querySelectorAll('#runs-table tbody tr'),
        function (r) { return Number(r.cells[th.cellIndex].dataset.v); });
      document.body.setAttribute('data-sorted', JSON.stringify(values));
    });"""
    proc, _ = _render(html, click, tmp_path)
    d_ks = json.loads(html_lib.unescape(re.search(r'data-sorted="([^"]*)"', proc.stdout).group(1)))
    assert len(d_ks) == 15 and d_ks == sorted(d_ks), d_ks


@pytest.mark.slow
def test_length_chart_renders_in_headless_chromium(length_page: Path, tmp_path: Path) -> None:
    """The length chart in a real browser: per task a row (reverse: 1 line, shift: 3), accuracy and loss panels,
    the training-length lines, the shift row on a log axis; no JS error."""
    got, _ = _probe(length_page.read_text(), tmp_path)
    (fig,) = [f for f in got["figures"] if f["id"] == "fig-lengths"]
    assert fig["traces"] == 2 * (1 + 3) and fig["svg"]
    evil = "\u2039script\u203aalert(1)\u2039/script\u203a · normalizer=softmax"
    shift = ["alibi · normalizer=softmax", "scaled_dot · normalizer=softmax", "scaled_dot · normalizer=sparsemax"]
    assert sorted(fig["names"]) == sorted([evil, *shift] * 2)
    assert fig["types"] == ["linear", "linear", "log", "log"]  # reverse: L = 8, 16; shift: L = 16 ... 256
    # one training-length line per panel, and a chance line on each accuracy panel
    assert fig["shapes"] == 4 + 2


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real multirun: 4 variants x d_k {8, 16} x lr {1e-3, 3e-3} = 16 smoke runs (two at a time); rope is a
    preset (its config holds scaled_dot and pos_encoding rope). The runs save no attention maps (their plot is most
    of a smoke run's time): the maps section's layout is checked with maps of a real run's size on the folder of
    sweeps (``test_a_folder_of_sweeps_page_fits_1400_px``)."""
    sweep = tmp_path_factory.mktemp("real") / "sweep"
    args = ["-m", "variant=additive,dot,rope,alibi", "d_k=8,16", "lr=1e-3,3e-3", "debug=fast"]
    args += ["logger=none", "threads=1", "results_table=false", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    args += ["diagnostics.heatmaps=false", "diagnostics.importance=true"]  # (the pruning chart: auto is off in sweeps)
    run_train(*args, f"hydra.sweep.dir='{sweep}'", wandb="disabled", full_error=True, timeout=600, returncode=0)
    return sweep


@pytest.mark.slow
def test_real_multirun_page_is_legible_at_1400_px(real_sweep: Path, tmp_path: Path) -> None:
    """The issue's check on a real sweep: plain legends and labels, every panel at least 300 px wide at a 1400 px
    window, the headline names the winner (computed here from the summaries), lr shows because it was swept, the
    runs table fits, variant=rope is labelled rope; a screenshot is kept in test-artifacts/."""
    runs = load_runs(real_sweep)
    assert len(runs) == 16 and all(r.ok for r in runs)
    combos = {(r.variant, r.d_k, r.value("lr")) for r in runs}
    assert len(combos) == 16
    out = dashboard.write_dashboard(real_sweep, tmp_path / "page.html")
    html = out.read_text()
    got, _ = _probe(html, tmp_path)
    assert got["viewport"] == 1400
    texts = got["legend"] + got["labels"] + got["verdicts"]
    for text in texts:
        for bad in ("&quot;", "&lt;", "{"):
            assert bad not in text, text
    # legends name the varying keys only: the variant (lr and d_k are panels or the x axis), or variant and lr
    # where the panels are the d_k values (training curves)
    variants = ["additive", "alibi", "dot", "rope"]  # (rope: the preset asked for, not "scaled_dot · pos=rope")
    with_lr = [f"{v} · lr={lr}" for v in variants for lr in ("0.001", "0.003")]
    # the pruning and rank charts draw every configuration (their x is the heads removed, the layer)
    configurations = [f"{v} · d_k={d_k} · lr={lr}" for v in variants for d_k in (8, 16) for lr in ("0.001", "0.003")]
    markers = [f"marker: d_k={d_k} · lr={lr}" for d_k in (8, 16) for lr in ("0.001", "0.003")]  # the Pareto legend
    pruning = [f"{c} · random" for c in configurations]
    assert set(got["legend"]) == {*variants, *with_lr, *configurations, *pruning, *markers}
    for fig in got["figures"]:
        assert fig["svg"] and fig["widths"] and min(fig["widths"]) >= 300, (fig["id"], fig["widths"])
    # the winner of test/acc (the headline digits declares), by hand from the summaries: best mean over seeds of a
    # (variant, d_k, lr) cell
    cells: dict = {}
    for r in runs:
        cells.setdefault((r.value("variant.name"), r.d_k, r.value("lr")), []).append(r.summary["metrics"]["test/acc"])
    means = {k: sum(v) / len(v) for k, v in cells.items()}
    best = max(means.values())
    winners = {f"{v} · lr={lr:g} at d_k={d_k}" for (v, d_k, lr), m in means.items() if abs(m - best) < 1e-12}
    verdict = got["verdicts"][0]
    assert verdict.startswith("Best test/acc: ") and any(w in verdict for w in winners), (verdict, winners)
    assert "lr=0.001" in " ".join(got["legend"] + got["labels"] + [t["text"] for t in got["tables"]])
    runs_table = next(t for t in got["tables"] if "runs" in t["cls"])
    assert runs_table["right"] <= 1400, runs_table["right"]
    shot = _screenshot(out, ARTIFACTS / "dashboard-real-sweep-1400.png", tmp_path)
    assert shot.stat().st_size > 10_000


@pytest.mark.slow
def test_a_folder_of_sweeps_page_fits_1400_px(folder_page: Path, tmp_path: Path) -> None:
    """The folder-of-sweeps page in Chromium at a 1400 px window: the headline tables fit (in a container that
    scrolls, should a name still not fit), the page itself does not scroll sideways, no half-width is printed with
    an exponent, and the attention maps are at least 600 px wide each (two a row: their ticks read)."""
    got, _ = _probe(folder_page.read_text(), tmp_path)
    assert got["viewport"] == 1400 and got["page_width"] <= 1400, got["page_width"]
    tables = [t for t in got["tables"] if t["cls"].split()[0] in ("headline", "rivals")]
    assert len(tables) == 4  # a table and its rivals for val/acc_best and test/acc
    for table in tables:
        assert table["overflow"] == "auto" and table["width"] <= table["room"] and table["right"] <= 1400, table
    assert all("e+" not in v and "e-" not in v for v in got["verdicts"]), got["verdicts"]
    assert len(got["maps"]) == 3  # the smoke sweep's variants saved maps
    assert len({round(m["top"]) for m in got["maps"]}) == 2  # two a row
    assert all(m["width"] >= 600 for m in got["maps"]), got["maps"]


def test_300_runs_build_fast_with_one_legend_entry_per_line(tmp_path: Path) -> None:
    """300 generated run folders (6 variants x 5 d_k x 2 heads x 5 seeds) make a page in at most 10 s (the
    issue's budget; typically 2-3 s here), with a legend of the 6 variants x 2 heads lines, not 300 runs."""
    root = tmp_path / "big"
    job = 0
    for variant in ("additive", "dot", "scaled_dot", "general", "t5_bias", "alibi"):
        for d_k in (8, 16, 32, 64, 128):
            for heads in (1, 4):
                for seed in range(5):
                    write_run(root / f"{job}_{variant}_{d_k}_{heads}_{seed}", variant, d_k, seed, num_heads=heads)
                    job += 1
    started = time.perf_counter()
    out = dashboard.write_dashboard(root, tmp_path / "big.html")
    elapsed = time.perf_counter() - started
    assert elapsed <= 10, f"300 runs took {elapsed:.1f} s"
    html = out.read_text()
    fig = _figure_json(html, "fig-1")
    names = {t["name"] for t in fig["data"] if t.get("showlegend")}
    assert names == {"additive", "alibi", "dot", "general", "scaled_dot", "t5_bias"}  # heads are the panels
    titles = [a["text"] for a in fig["layout"]["annotations"] if a["text"].startswith("val/acc_best")]
    assert titles == ["val/acc_best · heads=1", "val/acc_best · heads=4"]


def test_csv_export_has_one_row_per_run_with_final_and_init_metrics(tmp_path: Path) -> None:
    import csv

    sweep = tmp_path / "sweep"
    write_run(sweep / "0_dot", "dot", 8, 0)
    write_run(sweep / "1_scaled", "scaled_dot", 64, 1, status="failed", reason="training diverged at step 3")
    out = tmp_path / "summary.csv"
    assert dashboard.main([str(sweep), "-o", str(tmp_path / "page.html"), "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["variant"] for r in rows] == ["dot", "scaled_dot"]
    assert rows[0]["d_k"] == "8" and rows[0]["seed"] == "0" and rows[0]["status"] == "ok"
    assert rows[1]["status"] == "failed" and rows[1]["reason"] == "training diverged at step 3"
    assert float(rows[0]["test/acc"]) == pytest.approx(acc_of("dot", 8, 0))
    assert rows[0]["init/attn/saturation"] != ""


def test_a_panel_without_lines_gets_no_offsets() -> None:
    """A facet whose runs all lack the x key (a clip sweep beside MQAR runs, faceted by task) draws an empty panel;
    the sideways shifts must then be an empty list, not one shift for no line (that raised in zip(strict=True))."""
    from attnlab.dashboard import figures

    assert figures._offsets(0, None, [], False) == []
    (only,) = figures._offsets(1, None, [3.0], False)
    assert only(3.0) == 3.0
    shifts = figures._offsets(2, None, [1.0, 2.0], False)
    assert [round(f(1.0), 6) for f in shifts] == [0.875, 1.125]  # half the gap split between two lines


# ---------------------------------------------------------------------------------------------------- the views


@pytest.fixture
def my_stat() -> Iterator[str]:
    """A diagnostic the page and the CLI have never heard of, registered for every view; unregistered afterwards."""
    name = "attn/my_stat"
    made = register_metric(name, "my statistic", low=0.0, high=1.0, views=tuple(VIEWS))
    show_metric(name, *VIEWS, short="mine")  # (again: its title in the terminal table)
    yield name
    core_stats._FAMILIES[:] = [f for f in core_stats._FAMILIES if f[1] is not made]
    metrics_module._LISTED.pop(name)


def _add_metric(folder: Path, name: str, value: float) -> None:
    """Give a synthetic run ``name`` per head and overall at steps 0 and 100 (metrics.jsonl), finally and at step 0
    (summary.json)."""
    stat = name.removeprefix("attn/")
    per_head = {f"attn/L{layer}H{head}/{stat}": value for layer in range(LAYERS) for head in range(HEADS)}
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if "attn/entropy_norm" in row:
            row.update(per_head, **{name: value})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((folder / "summary.json").read_text())
    summary["metrics"][name] = summary["attn_init"][name] = value
    (folder / "summary.json").write_text(json.dumps(summary))


def test_a_registered_metric_appears_in_every_view_it_is_listed_in(tmp_path: Path, my_stat: str, capsys) -> None:
    """The page and the CLI hold no list of metrics: one registration puts a new diagnostic in the final-metrics
    and step-0 charts, the training curves, the per-head heatmaps, the runs tables and the CSV."""
    for i, (variant, d_k) in enumerate([("dot", 8), ("dot", 64), ("scaled_dot", 8), ("scaled_dot", 64)]):
        _add_metric(write_run(tmp_path / "runs" / str(i), variant, d_k, 0), my_stat, 0.25 * i)
    assert my_stat in metrics_in("final") and my_stat in metrics_in("csv")
    runs = load_runs(tmp_path / "runs")
    html = build_html(runs)

    def figure_of(section: str) -> dict:
        body = html[html.index(f'<section id="{section}">') :]
        return _figure_json(html, re.search(r'data-figure="([\w-]+)-json"', body).group(1))

    for section in ("final", "init", "curves"):
        titles = [a["text"] for a in figure_of(section)["layout"]["annotations"]]
        assert any(title.startswith(my_stat) for title in titles), (section, titles)
    heads = html[html.index('<section id="heads">') :]
    choices = re.search(r'<script type="application/json" id="(heads-\d+)-choices">(.*?)</script>', html, re.S)
    assert choices is not None and "heads-" in heads
    figure = json.loads(choices.group(2))["0"]
    assert [a["text"] for a in figure["layout"]["annotations"]][-1] == "final my_stat"
    table = html[html.index('<table class="runs sortable"') :]
    assert re.findall(r'data-key="([^"]+)"', table)[-3:] == ["attn/entropy_norm", "attn/saturation", my_stat]
    out = dashboard.write_csv(runs, tmp_path / "runs.csv")
    header = next(csv.reader(out.open()))
    assert my_stat in header and f"init/{my_stat}" in header
    rows = list(csv.DictReader(out.open()))
    assert [float(r[my_stat]) for r in rows] == [0.0, 0.25, 0.5, 0.75]
    dashboard.print_table(runs)
    assert " mine " in capsys.readouterr().out


def test_views_and_their_registration_errors() -> None:
    assert metrics_in("curve") == [
        "train/loss",
        "val/acc",
        "attn/entropy_norm",
        "attn/saturation",
        "attn/induction_max",
    ]
    assert metrics_in("length") == ["test/acc", "test/loss", "test/bpc"]
    assert metrics_in("table") == ["attn/entropy_norm", "attn/saturation"]
    assert metrics_in("head") == ["attn/entropy_norm", "attn/saturation", "attn/induction"]
    with pytest.raises(ValueError, match=r"^unknown dashboard view 'curves'; did you mean 'curve'\?"):
        show_metric("attn/x", "curves")
    with pytest.raises(ValueError, match=r"^unknown dashboard view 'heads'; did you mean 'head'\?"):
        metrics_in("heads")
    with pytest.raises(ValueError, match=r"views=\.\.\. lists one metric by name; '\.\*/acc' is a pattern"):
        register_metric(r".*/acc", "accuracy", views=("final",))
    assert "attn/x" not in metrics_module.listed_metrics()


# ---------------------------------------------------------------------------------------------------- issue 40
def test_csv_text_cells_never_start_a_formula_and_numbers_stay_numbers(tmp_path: Path) -> None:
    hostile = ['=HYPERLINK("http://evil","x")', "+1+1", "-2+3", "@SUM(A1)"]
    for i, name in enumerate(hostile):
        write_run(tmp_path / "sweep" / f"{i}_{name.strip('=+-@')[:6]}", name, 16, i % 2, task=name)
    runs = load_runs(tmp_path / "sweep")
    path = dashboard.write_csv(runs, tmp_path / "runs.csv")
    rows = list(csv.reader(path.open()))
    header, body = rows[0], rows[1:]
    variants = [row[header.index("variant")] for row in body]
    assert sorted(variants) == sorted("'" + name for name in hostile)
    assert sorted(row[header.index("task")] for row in body) == sorted("'" + name for name in hostile)
    for row in body:
        for cell in row:
            if cell[:1] in ("=", "+", "-", "@"):  # only a number may start so (none of these runs has one)
                float(cell)
    assert [float(row[header.index("test/acc")]) for row in body] == [r.final("test/acc") for r in runs]
    assert all(row[header.index("seed")] in ("0", "1") for row in body)


def test_a_read_only_folder_is_one_line_naming_it_and_the_way_out(
    sweeps: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """Issue 40: the page's folder cannot be written (read-only): exit 2, one line naming the folder and -o, and
    nothing written (as root, whom permissions do not stop, the write is made to fail as a read-only file system
    makes it fail)."""
    import errno

    folder = tmp_path / "ro"
    shutil.copytree(sweeps / "sweep_a" / "0_d_k=8,seed=0,variant=dot", folder)
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    if os.geteuid() == 0:
        from attnlab.dashboard import cli

        def refuse(path, mode="w"):
            raise OSError(errno.EROFS, "Read-only file system", str(Path(path).parent / f".{Path(path).name}.1.tmp"))

        monkeypatch.setattr(cli, "atomic_open", refuse)
    else:
        folder.chmod(0o555)
    try:
        assert main([str(folder), "--csv", str(folder / "runs.csv")]) == 2
    finally:
        folder.chmod(0o755)
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("attnlab-dashboard: error: cannot write ") and f"the folder {folder} is read-only" in line
    assert "-o /tmp/dashboard.html" in line and "Traceback" not in captured.err
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before  # no page, no CSV, no temporary file


def test_the_mqar_chance_line_is_labelled_as_what_it_is(tmp_path: Path) -> None:
    """associative_recall's chance_accuracy is 1/num_pairs (a guess among the context's values), not a uniform
    guess over the 32 values: the dashed line says 1/num_pairs, and the page says what it is."""
    datamodule = {"num_pairs": 8, "vocab_values": 32}
    for i, (variant, seed) in enumerate([("dot", 0), ("dot", 1), ("scaled_dot", 0), ("scaled_dot", 1)]):
        folder = write_run(tmp_path / f"{i}_{variant}", variant, 16, seed, task="associative_recall",
                           datamodule=datamodule)  # fmt: skip
        summary = json.loads((folder / "summary.json").read_text())
        (folder / "summary.json").write_text(json.dumps({**summary, "chance_accuracy": 1 / 8}))
    runs = load_runs(tmp_path)
    fig = dashboard.figures.comparison_figure(runs, Sweep(runs), ["test/acc"], None, None)
    texts = [a["text"] for a in fig["layout"]["annotations"]]
    assert "1/num_pairs 12.5 %" in texts and not any(t.startswith("chance") for t in texts)
    (note,) = [a for a in fig["layout"]["annotations"] if a["text"] == "1/num_pairs 12.5 %"]
    assert "1/vocab_values" in note["hovertext"]
    html = html_lib.unescape(build_html(runs))
    assert "The dashed line of associative_recall is 1/num_pairs: the task's chance_accuracy" in html


def test_entropies_of_rows_that_are_no_distribution_say_so(tmp_path: Path) -> None:
    """A run whose rows do not sum to 1 (GLA, the delta rule: row mass 0.62) or are signed: its entropy_norm is
    drawn with a note on the section and on its per-head heatmap; a softmax run's is not."""
    for i, (variant, seed) in enumerate([("dot", 0), ("dot", 1), ("gla", 0), ("gla", 1)]):
        folder = write_run(tmp_path / f"{i}_{variant}", variant, 16, seed)
        summary = json.loads((folder / "summary.json").read_text())
        summary["metrics"]["attn/row_mass"] = 0.62 if variant == "gla" else 1.0
        (folder / "summary.json").write_text(json.dumps(summary))
    runs = load_runs(tmp_path)
    html = html_lib.unescape(build_html(runs))
    final = html[html.index('<section id="final">') :]
    final = final[: final.index("</section>")]
    assert "Not entropies of a distribution for gla" in final and "row mass 0.62" in final and "dot," not in final
    gla = next(r for r in runs if r.variant == "gla")
    dot = next(r for r in runs if r.variant == "dot")
    notes = [a["text"] for a in dashboard.figures.head_figure(gla, ["entropy_norm"])["layout"]["annotations"]]
    assert any(t.startswith("Not a distribution: rows that do not sum to 1 (row mass 0.62)") for t in notes)
    notes = [a["text"] for a in dashboard.figures.head_figure(dot, ["entropy_norm"])["layout"]["annotations"]]
    assert not any("distribution" in t for t in notes)


def test_empty_sections_say_why_from_the_runs_configs(tmp_path: Path) -> None:
    """experiment=mqar sets diagnostics.heatmaps=false (and these runs also have diagnostics.heads=false on the
    command line): the attention-maps and head-atlas sections say so instead of a generic list of causes."""
    for i, seed in enumerate((0, 1)):
        write_run(tmp_path / f"{i}_dot", "dot", 16, seed, extra={"diagnostics": {"heatmaps": False, "heads": False}},
                  overrides=["experiment=mqar", "diagnostics.heads=false", f"seed={seed}"])  # fmt: skip
    html = html_lib.unescape(build_html(load_runs(tmp_path)))

    def section(anchor: str) -> str:
        start = html.index(f'<section id="{anchor}">')
        return html[start : html.index("</section>", start)]

    assert "Here: diagnostics.heatmaps=false in every run (set by experiment=mqar)." in section("maps")
    assert "Here: diagnostics.heads=false in every run (set on the command line)." in section("atlas")
