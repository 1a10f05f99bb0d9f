"""The benchmark harness runs (``--quick``) and writes its files; its measured ratios are never asserted (targets
are checked by the harness itself, not by timed tests). Plus the fused-kernel check, on the CPU and on CUDA."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.bench import (
    ATTENTION_VARIANTS,
    VARIANT_GOALS,
    FusedKernelUnavailable,
    ModelSpec,
    Options,
    bench_variants,
    build_model,
    check_fused_sdpa,
    evaluate_targets,
    format_tables,
    machine_info,
    naive_additive_logits,
    parse_args,
    quick_plan,
    write_results,
)
from attnlab.scores import AdditiveScore

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_bench_writes_json_and_csv_with_positive_ratios(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab.bench", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| target |" in proc.stdout
    # quick numbers are labelled as such and never judged against the goals
    assert "QUICK RUN (--quick)" in proc.stdout and "not judged against the goals" in proc.stdout
    assert "targets were missed" not in proc.stdout

    results = json.loads((tmp_path / "bench.json").read_text())
    machine = results["machine"]
    for key in ("date", "platform", "cpu_model", "usable_cores", "torch", "threads", "device", "dtype"):
        assert machine[key] not in (None, ""), key
    assert machine["threads"] == 1

    rows = list(csv.DictReader((tmp_path / "bench.csv").open()))
    encoder = [r for r in rows if r["section"] == "encoder"]
    assert {r["score"] for r in encoder} >= {"torch", "scaled_dot", "relative_position", "t5_bias", "alibi", "additive"}
    for r in encoder:
        assert float(r["median_ms"]) > 0 and float(r["tokens_per_s"]) > 0
        assert float(r["ratio_scaled_dot"]) > 0
        assert r["sdpa_kernel"]
    assert all(float(r["ratio_torch"]) > 0 for r in rows if r["section"] == "mha")
    variants = [r for r in rows if r["section"] == "variants"]
    assert {r["variant"] for r in variants} == set(ATTENTION_VARIANTS)
    assert all(float(r["ratio_scaled_dot"]) > 0 for r in variants)

    targets = list(csv.DictReader((tmp_path / "targets.csv").open()))
    by_id = {}
    for t in targets:
        by_id.setdefault(t["id"], []).append(t)
    for tid in ("1", "2", "3", "4", "16a"):
        for t in by_id[tid]:
            assert float(t["value"]) > 0, t
    assert len(by_id["3"]) == 3
    assert len(by_id["7"]) == 6 and len(by_id["8"]) == 6
    assert len(by_id["16c"]) == 2 and len(by_id["16b"]) == 1  # the bare block stacks' goals
    assert {r["variant"] for r in results["blocks"]} == {"scaled_dot", "relative_position", "t5_bias", "additive",
                                                          "additive_chunked", "additive_naive"}  # fmt: skip
    judged = ("1", "2", "3", "4", "7", "8", "16a", "16b", "16c")
    assert all(t["met"] == "" for tid in judged for t in by_id[tid])  # not judged
    assert results["additive_memory"]["max_rel_diff"] < 1e-4
    assert results["diagnostics"]["wall_with_s"] and results["diagnostics"]["wall_without_s"]


def test_fused_kernel_check_on_cpu_finds_flash_and_explains_a_refusal(single_thread):
    assert check_fused_sdpa("cpu", torch.float32, length=16) == "flash"
    # T5's learned bias on the CPU goes to attnlab's fused relative-position kernel
    assert check_fused_sdpa("cpu", torch.float32, score="t5_bias", length=16) == "relative"
    # with dropout it needs SDPA, which can only run a bias that needs a gradient in its math kernel: said so
    with pytest.raises(FusedKernelUnavailable, match="could not dispatch attnlab 't5_bias' to a fused kernel"):
        check_fused_sdpa("cpu", torch.float32, score="t5_bias", length=16, dropout=0.1)


def test_naive_additive_reference_equals_the_chunked_score(single_thread):
    """The harness's memory baseline computes the same thing as AdditiveScore (float64, values and gradients)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    score = AdditiveScore(4, 3, d_attn=3, chunk_size=2, save_elements=0).double()
    params = [q, k, score.w_q, score.w_k, score.v]
    a, b = score(q, k), naive_additive_logits(q, k, score.w_q, score.w_k, score.v)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    c = torch.randn(a.shape, generator=gen, dtype=torch.float64)
    for ga, gb in zip(torch.autograd.grad(a, params, c), torch.autograd.grad(b, params, c), strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scaled_dot_dispatches_to_a_fused_kernel_on_cuda_bf16():
    assert check_fused_sdpa("cuda", torch.bfloat16) in ("flash", "efficient", "cudnn")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_bench_runs_on_cuda_bf16(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab.bench", "--quick", "--device", "cuda", "--dtype", "bf16", "--out", tmp_path],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["fused"]["kernel"] in ("flash", "efficient", "cudnn")


def test_every_bench_run_gets_its_own_results_folder_and_latest_points_to_it(tmp_path):
    from attnlab.bench import new_results_dir

    first = new_results_dir(tmp_path, quick=False)
    (first / "bench.json").write_text("{}")
    second = new_results_dir(tmp_path, quick=True)
    assert first != second and first.is_dir() and second.name.endswith("-quick")
    assert (first / "bench.json").read_text() == "{}"  # an earlier run's results are never overwritten
    assert (tmp_path / "latest").resolve() == second.resolve()


EAGER = {"softcap50", "sparsemax", "entmax15"}  # never expressible as SDPA; the others' flags are read off the module


def test_variants_section_times_every_variant_against_scaled_dot_and_saves_its_rows(tmp_path, single_thread):
    """The quick plan's variants section (tiny shapes, one round, no profiling): a row per variant and length with
    its ratio to scaled_dot and its fast-path flag, in the table, bench.csv and targets.csv (labelled, not
    judged). Timings are not asserted."""
    plan = quick_plan()
    rows = bench_variants(plan, torch.device("cpu"), torch.float32, log=lambda msg: None)
    lengths = [s.length for s in plan.variant_shapes]
    assert len(lengths) >= 2 and plan.target_variant_length in lengths
    assert [(r["variant"], r["length"]) for r in rows] == [(v, n) for n in lengths for v in ATTENTION_VARIANTS]
    for r in rows:
        assert r["section"] == "variants" and r["group"] == f"L{r['length']}" and r["reps"] == 1
        assert r["median_ms"] > 0 and r["ratio_scaled_dot"] > 0
        model = build_model(ModelSpec.of_variant(r["variant"], plan.variant_shapes[0]))
        attention = model.encoder.layers[0].self_attn
        assert r["fast_path"] is attention.uses_fast_path, r["variant"]
        if r["variant"] in EAGER or r["variant"] == "scaled_dot":
            assert r["fast_path"] is (r["variant"] == "scaled_dot"), r["variant"]
        if r["variant"] == "scaled_dot":
            assert r["ratio_scaled_dot"] == 1.0 and r["options"] == "(reference)"
    assert {r["score"] for r in rows} == {"scaled_dot", "cosine"}
    assert {v for _, names, _ in VARIANT_GOALS for v in names} <= set(ATTENTION_VARIANTS)

    results = {"machine": machine_info(torch.device("cpu"), torch.float32), "quick": True, "variants": rows}
    results["targets"] = evaluate_targets(plan, results)
    goals = [t for t in results["targets"] if t["id"] in ("7", "8")]
    assert len(goals) == sum(len(names) for _, names, _ in VARIANT_GOALS)
    assert all(t["value"] > 0 and t["met"] is None for t in goals)  # a quick run is never judged

    table = format_tables(results)
    assert "QUICK RUN (--quick)" in table
    for name in ATTENTION_VARIANTS:
        assert f"| {name} |" in table
    assert "| sparsemax | normalizer=sparsemax | no (eager) |" in table
    write_results(results, tmp_path)
    saved = [r for r in csv.DictReader((tmp_path / "bench.csv").open()) if r["section"] == "variants"]
    assert len(saved) == len(rows) and {r["fast_path"] for r in saved} == {"True", "False"}
    assert {r["variant"] for r in saved} == set(ATTENTION_VARIANTS)
    assert len(json.loads((tmp_path / "bench.json").read_text())["variants"]) == len(rows)
    targets = [t for t in csv.DictReader((tmp_path / "targets.csv").open()) if t["id"] in ("7", "8")]
    assert len(targets) == len(goals) and all(t["met"] == "" for t in targets)


def test_variants_goals_are_judged_on_a_full_plan_and_only_picks_the_section():
    plan = quick_plan()
    plan.quick = False
    rows = [
        {"variant": v, "length": plan.target_variant_length, "ratio_scaled_dot": 3.0 if v == "rope" else 1.0}
        for v in ATTENTION_VARIANTS
    ]
    for row in rows:
        row["fast_path"] = row["variant"] not in EAGER
    targets = {t["what"].split()[0]: t for t in evaluate_targets(plan, {"variants": rows}) if t["id"] in ("7", "8")}
    assert targets["rope"]["met"] is False and targets["gqa2"]["met"] is True
    assert targets["sparsemax"]["met"] is True and targets["sparsemax"]["note"] == "eager"
    assert targets["softmax1"]["note"] == "fast path"
    opts = parse_args(["--quick", "--only", "variants", "--reps", "2"])
    assert isinstance(opts, Options) and opts.only == ["variants"] and opts.reps == 2
