"""The dashboard reads ``metrics.jsonl`` as a stream into a bounded :class:`attnlab.dashboard.load.MetricLog`: the
same answers as reading every row (checked against a plain reading written here), curves thinned to
:data:`~attnlab.dashboard.load.CURVE_POINTS`, and a peak memory far below the file's size."""

from __future__ import annotations

import gc
import json
import math
import os
import re
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnlab.dashboard import load
from attnlab.dashboard.load import CURVE_POINTS, Run, load_run

HUGE = "1" + "0" * 400  # an integer beyond any float

LINES = [
    '{"step": 0, "train/loss": 2.5, "attn/entropy_norm": 0.9, "attn/L0H0/entropy": 0.5, "attn/L0H1/entropy": 0.6,'
    ' "attn/L1H0/entropy": null, "attn/L0H0/saturation": 0.1}',
    '{"step": 0, "attn/saturation": NaN, "attn/logit_std": null, "attn/max_prob": 0.2}',
    '{"step": 0.0, "attn/saturation": 0.25, "attn/logit_std": 1.5, "x": "0.5"}',
    '{"step": false, "attn/max_prob": 0.3, "attn/logit_max": 4.0}',  # false == 0: a step-0 row, but no curve step
    '{"epoch": 1, "train/loss": 1.0, "attn/L0H0/saturation": 0.15}',  # no step: final and heads, no curve
    '{"step": null, "train/loss": 7.0, "attn/L3H2/entropy": 0.4}',
    "",
    "   ",
    "[1, 2]",
    '"a string"',
    "{not json",
    '{"step": "x", "val/acc": 0.3}',
    '{"step": 10, "train/loss": null, "val/acc": 0.5, "test/acc@64": 0.7, "test/acc@128": NaN, "big": ' + HUGE + "}",
    '{"step": 20, "train/loss": Infinity, "val/acc": 0.6, "attn/L0H0/entropy": 0.55, "attn/L1H1/entropy": null,'
    ' "test/acc@64": 0.75, "test/acc@x": 0.1, "test/acc@128": null, "attn/L0H0/max-prob": 0.9, "epoch": 2}',
    '{"step": 25, "train/loss": -Infinity, "val/acc": [1], "attn/L0H1/saturation": 0.2, "flag": true,'
    ' "attn/0H1/entropy": 0.3, "attn/L9H9/entropy/x": 1}',
    '{"step": 30, "train/loss": 0.4, "attn/saturation": NaN, "val/acc": {"a": 1}, "x": 3}',
    '{"step": 40, "train/loss": 0.',  # a killed writer's torn last line
]


def plain_rows(text: str) -> list[dict[str, Any]]:
    """Every row of a metrics.jsonl text, read the plain way."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def number(value: Any) -> float | None:
    """A finite float, or None (booleans, null, NaN, inf, non-numbers)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


def plain_final(rows: list[dict[str, Any]], key: str) -> float | None:
    for row in reversed(rows):
        if number(row.get(key)) is not None:
            return number(row[key])
    return None


def plain_init(rows: list[dict[str, Any]], key: str) -> float | None:
    for row in rows:
        if row.get("step") == 0 and number(row.get(key)) is not None:
            return number(row[key])
    return None


def plain_curve(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for row in rows:
        if key in row and number(row.get("step")) is not None:
            steps.append(float(row["step"]))
            value = number(row[key])
            values.append(math.nan if value is None else value)
    return steps, values


def plain_head_grid(rows: list[dict[str, Any]], metric: str) -> np.ndarray | None:
    for row in reversed(rows):
        cells = {}
        for key, value in row.items():
            parts = key.split("/")  # attn/L0H0/max-prob is no per-head metric: the name must be \w+
            if len(parts) == 3 and parts[0] == "attn" and parts[2] == metric and re.fullmatch(r"\w+", metric):
                layer, _, head = parts[1][1:].partition("H") if parts[1][:1] == "L" else ("", "", "")
                if layer.isdigit() and head.isdigit():
                    cells[int(layer), int(head)] = number(value)
        if cells:
            grid = np.full((1 + max(c[0] for c in cells), 1 + max(c[1] for c in cells)), np.nan)
            for (layer, head), value in cells.items():
                grid[layer, head] = np.nan if value is None else value
            return grid
    return None


def test_streamed_log_answers_like_a_plain_reading_of_every_row(tmp_path: Path) -> None:
    text = "\n".join(LINES)
    (tmp_path / "metrics.jsonl").write_text(text)
    rows = plain_rows(text)
    assert len(rows) == 11
    keys = {key for row in rows for key in row}
    for run in (load_run(tmp_path), Run(tmp_path, "in memory", rows=rows)):
        assert run.problems == []
        assert run.metric_log.row_count == len(rows)
        assert run.metric_names == keys - {"step", "epoch"}
        for key in sorted(keys | {"nope"}):
            assert run.final(key) == plain_final(rows, key), key
            assert run.init(key) == plain_init(rows, key), key
            steps, values = run.curve(key)
            want_steps, want_values = plain_curve(rows, key)
            assert steps.dtype == values.dtype == np.float64
            np.testing.assert_array_equal(steps, want_steps, err_msg=key)
            np.testing.assert_array_equal(values, want_values, err_msg=key)  # NaN where NaN
        for metric in ("entropy", "saturation", "max_prob", "max-prob", "nope"):
            grid, want = run.head_grid(metric), plain_head_grid(rows, metric)
            assert (grid is None) == (want is None), metric
            if want is not None:
                np.testing.assert_array_equal(grid, want, err_msg=metric)
        assert run.by_length("test/acc") == {64: 0.75}
    # spot checks of what the plain reading says, so that both cannot be wrong together
    run = load_run(tmp_path)
    assert (run.final("train/loss"), run.final("big"), run.final("x"), run.final("flag")) == (0.4, None, 3.0, None)
    assert (run.init("attn/saturation"), run.init("attn/logit_std"), run.init("attn/logit_max")) == (0.25, 1.5, 4.0)
    assert run.curve("train/loss")[0].tolist() == [0.0, 10.0, 20.0, 25.0, 30.0]
    entropy = run.head_grid("entropy")  # the step-20 row only: L3H2 (an earlier row) is not in it
    assert entropy is not None and entropy.shape == (2, 2) and entropy[0, 0] == 0.55
    assert np.isnan(entropy[[0, 1, 1], [1, 0, 1]]).all()
    saturation = run.head_grid("saturation")
    assert saturation is not None and saturation.shape == (1, 2) and saturation[0, 1] == 0.2


def test_an_unreadable_metrics_file_is_a_problem_of_the_run(tmp_path: Path) -> None:
    (tmp_path / "elsewhere.jsonl").write_text('{"step": 1, "train/loss": 1.0}\n')
    os.symlink(tmp_path / "elsewhere.jsonl", tmp_path / "metrics.jsonl")
    run = load_run(tmp_path)
    assert len(run.problems) == 1 and "metrics.jsonl" in run.problems[0]
    assert run.final("train/loss") is None and run.curve("train/loss")[0].size == 0


def test_a_long_curve_is_thinned_evenly_keeping_the_first_and_last_points() -> None:
    n = 3 * CURVE_POINTS + 7
    steps = [5 * i for i in range(n)]
    values = [None if i % 97 == 3 else math.sin(i / 50) for i in range(n)]
    rows = []
    for step, value in zip(steps, values, strict=True):
        rows += [{"step": step, "train/loss": value}, {"step": step, "val/acc": 0.5}]
    run = Run(Path("x"), "long", rows=rows)
    got_steps, got_values = run.curve("train/loss")
    assert CURVE_POINTS // 2 <= got_steps.size <= CURVE_POINTS
    assert got_steps[0] == steps[0] and got_steps[-1] == steps[-1]
    index = [steps.index(int(s)) for s in got_steps]  # a subset of the points, in order
    assert index == sorted(set(index))
    for i, value in zip(index, got_values.tolist(), strict=True):
        assert value == values[i] or (values[i] is None and math.isnan(value))
    assert len(set(np.diff(index[:-1]).tolist())) == 1  # evenly spread (the last point besides)
    assert run.final("train/loss") == values[-1] and run.curve("val/acc")[0].size <= CURVE_POINTS
    # up to CURVE_POINTS points, the curve is every point
    run = Run(Path("x"), "full", rows=[{"step": s, "m": float(s)} for s in range(CURVE_POINTS)])
    assert run.curve("m")[0].tolist() == [float(s) for s in range(CURVE_POINTS)]


def test_runs_of_different_lengths_share_their_steps_at_the_largest_stride() -> None:
    long = Run(Path("x"), "long", rows=[{"step": 10 * i, "m": 1.0} for i in range(5 * CURVE_POINTS)])
    short = Run(Path("x"), "short", rows=[{"step": 10 * i, "m": 3.0} for i in range(CURVE_POINTS + 3)])
    assert (short.curve_stride("m"), long.curve_stride("m"), short.curve_stride("nope")) == (2, 8, 1)
    assert set(short.curve("m")[0][:-1]) - set(long.curve("m")[0])  # as thinned, the short run has other steps
    stride = max(run.curve_stride("m") for run in (long, short))
    steps, values = short.curve("m", stride)
    assert set(steps[:-1]) <= set(long.curve("m")[0]) and steps[-1] == 10 * (CURVE_POINTS + 2)
    assert steps.tolist() == [*range(0, 10 * (CURVE_POINTS + 3), 10 * stride), 10 * (CURVE_POINTS + 2)]
    assert values.tolist() == [3.0] * steps.size
    assert long.curve("m", 1)[0].tolist() == long.curve("m")[0].tolist()  # a finer stride than the kept one
    with pytest.raises(ValueError, match="not a multiple"):
        long.curve("m", 12)


def test_thinning_holds_its_bound_at_every_length(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load, "CURVE_POINTS", 8)
    log = load.MetricLog()
    for n in range(1, 300):
        log.add({"step": n - 1, "m": float(n - 1)})
        steps, values = log.curve("m")
        assert steps.tolist() == values.tolist()
        kept = [int(s) for s in steps]
        if n <= 8:
            assert kept == list(range(n))
            continue
        assert 4 <= len(kept) <= 8 and kept[0] == 0 and kept[-1] == n - 1
        stride = kept[1] - kept[0]
        assert stride & (stride - 1) == 0 and kept[:-1] == list(range(0, kept[-2] + 1, stride)), n
        assert kept[-1] - kept[-2] <= stride


def write_metrics(path: Path, rows: int) -> list[str]:
    """A metrics.jsonl of ``rows`` rows of 52 keys (40 of them per head), written from a template; returns the keys."""
    keys = ["train/loss", "train/acc", "val/loss", "val/acc", "lr", "grad_norm"]
    keys += ["attn/entropy_norm", "attn/saturation", "attn/max_prob", "attn/logit_std"]
    heads = ("entropy", "entropy_norm", "saturation", "max_prob", "logit_std")
    keys += [f"attn/L{layer}H{head}/{m}" for layer in range(2) for head in range(4) for m in heads]
    body = ", ".join(f'"{key}": %(v{i % 5}).9f' for i, key in enumerate(keys))
    template = '{"step": %(step)d, "epoch": %(epoch)d, ' + body + "}\n"
    with path.open("w") as f:
        for step in range(rows):
            x = step / rows
            f.write(
                template
                % {"step": step, "epoch": step // 500, "v0": x, "v1": 1 - x, "v2": x * x, "v3": 2 - x, "v4": x / 3}
            )
    return ["step", "epoch", *keys]


def test_loading_a_large_metrics_file_peaks_far_below_its_size(tmp_path: Path) -> None:
    rows = 20_000
    keys = write_metrics(tmp_path / "metrics.jsonl", rows)
    size = (tmp_path / "metrics.jsonl").stat().st_size
    assert size > 30e6
    gc.collect()
    tracemalloc.start()
    try:
        run = load_run(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert run.problems == [] and run.metric_log.row_count == rows
    steps, values = run.curve("attn/L1H3/saturation")
    assert CURVE_POINTS // 2 <= steps.size <= CURVE_POINTS and (steps[0], steps[-1]) == (0, rows - 1)
    last = (rows - 1) / rows
    assert values[-1] == pytest.approx(last * last, abs=1e-9)  # the key's template value is x * x
    assert run.head_grid("entropy").shape == (2, 4) and run.final("train/loss") == pytest.approx(last, abs=1e-9)
    # a fixed bound per key (two arrays of CURVE_POINTS doubles, with growth slack), not a share of the file
    assert peak < 1_048_576 + len(keys) * 40 * 1024, peak
    assert peak < 0.1 * size, (peak, size)  # measured: about 0.05 x this file
