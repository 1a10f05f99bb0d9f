"""Unit tests for the dashboard's sweep analysis (dims), statistics over seeds (stats) and metric registry (metrics).

Runs are built in memory (no folders, no training). Every expected number is computed here by hand: plain loops,
the textbook mean, the sample standard deviation with n - 1 and the Student-t quantile from scipy.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy.stats import t as student_t

from attnlab import stats as core_stats
from attnlab.dashboard import stats as stats_module
from attnlab.dashboard.dims import Sweep
from attnlab.dashboard.load import MISSING, Run
from attnlab.dashboard.metrics import register_metric
from attnlab.dashboard.stats import MAX_CURVE_POINTS, Cell, Point, aggregate, best_runs, curves, headline
from attnlab.stats import (
    MetricSpec,
    holm,
    interval_text,
    mean_ci,
    paired_difference,
    parse_metric,
    spec_for,
    t_critical,
    t_two_sided_p,
    welch_difference,
)

# ---------------------------------------------------------------------------------------------------- helpers
BASE_CONFIG: dict[str, Any] = {
    "variant": {"name": "scaled_dot", "params": {}},
    "normalizer": {"name": "softmax"},
    "mask": {"name": "none"},
    "model": {"pos_encoding": "sinusoidal", "d_ff": None, "dropout": 0.0, "betas": [0.9, 0.98]},
    "task": {"name": "digits", "datamodule": {"num_val": 270, "batch_size": 16, "seed": 0}},
    "trainer": {"max_steps": 300, "log_every_n_steps": 10, "precision": "32-true"},
    "logger": {"name": "wandb", "project": "attnlab", "tags": []},
    "diagnostics": {"enabled": True, "every_n_steps": 100},
    "d_model": 64,
    "d_k": None,
    "num_heads": 4,
    "num_layers": 2,
    "lr": 3e-3,
    "batch_size": 16,
    "max_steps": 300,
    "seed": 0,
    "threads": "auto",
    "optimized_metric": "val/acc_best",
    "resume": False,
}

_counter = itertools.count()


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    node = config
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def make_run(
    cfg: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    status: str = "ok",
    metrics: dict[str, float] | None = None,
    rows: list[dict[str, Any]] | None = None,
    params: int | None = 123,
) -> Run:
    """A run as the dashboard reads it: the base config with ``cfg``'s dotted overrides, the interpolated mirrors
    (``trainer.max_steps: ${max_steps}``, ``task.datamodule.seed: ${seed}``, ...) resolved like Hydra does."""
    config = copy.deepcopy(BASE_CONFIG)
    config["seed"] = seed
    for key, value in (cfg or {}).items():
        _set(config, key, value)
    config["trainer"]["max_steps"] = config["max_steps"]
    config["task"]["datamodule"]["seed"] = config["seed"]
    config["task"]["datamodule"]["batch_size"] = config["batch_size"]
    summary = {"status": status, "seed": seed, "params": params, "metrics": dict(metrics or {})}
    return Run(path=Path("x"), name=f"r{next(_counter)}", config=config, summary=summary, rows=list(rows or []))


def hand_ci(values: list[float]) -> tuple[float, float | None, int]:
    """Textbook mean and 95 % t half-width over ``values`` (already finite)."""
    n = len(values)
    total = 0.0
    for v in values:
        total += v
    mean = total / n
    if n < 2:
        return mean, None, n
    squares = 0.0
    for v in values:
        squares += (v - mean) ** 2
    s = math.sqrt(squares / (n - 1))
    return mean, float(student_t.ppf(0.975, n - 1)) * s / math.sqrt(n), n


def hand_paired(a: dict[Any, float], b: dict[Any, float]) -> tuple[float, float, float, int]:
    """Textbook paired t over the seeds in both: (mean of d_i = a_i - b_i, 95 % half-width, two-sided p, n)."""
    d = []
    for seed in a:
        if seed in b:
            d.append(a[seed] - b[seed])
    n = len(d)
    total = 0.0
    for v in d:
        total += v
    mean = total / n
    squares = 0.0
    for v in d:
        squares += (v - mean) ** 2
    se = math.sqrt(squares / (n - 1)) / math.sqrt(n)
    t = mean / se
    return mean, float(student_t.ppf(0.975, n - 1)) * se, float(2 * student_t.sf(abs(t), n - 1)), n


def hand_welch(a: list[float], b: list[float]) -> tuple[float, float, float, float]:
    """Textbook Welch: (mean a - mean b, 95 % half-width, two-sided p, Welch-Satterthwaite df)."""
    stats = []
    for xs in (a, b):
        total = 0.0
        for v in xs:
            total += v
        mean = total / len(xs)
        squares = 0.0
        for v in xs:
            squares += (v - mean) ** 2
        stats.append((mean, squares / (len(xs) - 1), len(xs)))
    (ma, va, na), (mb, vb, nb) = stats
    se2 = va / na + vb / nb
    df = se2**2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    t = (ma - mb) / math.sqrt(se2)
    return ma - mb, float(student_t.ppf(0.975, df)) * math.sqrt(se2), float(2 * student_t.sf(abs(t), df)), df


def hand_holm(p: list[float]) -> list[float]:
    """Holm's step-down adjustment, plainly: sort ascending, multiply the j-th smallest by m - j + 1, cap at 1,
    carry the running maximum; back in the input order."""
    m = len(p)
    order = list(range(m))
    order.sort(key=lambda i: p[i])
    adjusted = [0.0] * m
    running = 0.0
    j = 0
    for i in order:
        j += 1
        value = (m - j + 1) * p[i]
        if value > 1.0:
            value = 1.0
        if value > running:
            running = value
        adjusted[i] = running
    return adjusted


def dim_keys(sweep: Sweep) -> list[str]:
    return [d.key for d in sweep.dims]


def factorial(**axes: list[Any]) -> list[dict[str, Any]]:
    """Every combination of the dotted keys' values (a full factorial: no key is a function of another)."""
    keys = list(axes)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(axes[k] for k in keys))]


# ---------------------------------------------------------------------------------------------------- Sweep
def test_a_key_that_differs_is_a_dimension_and_an_equal_key_a_constant() -> None:
    runs = [make_run({"lr": lr, "d_model": 64}) for lr in (1e-3, 3e-3, 1e-2)]
    sweep = Sweep(runs)
    assert dim_keys(sweep) == ["lr"]
    assert sweep.dims[0].values == (1e-3, 3e-3, 1e-2)
    assert sweep.constants["d_model"] == 64
    assert sweep.constants["variant.name"] == "scaled_dot"
    assert "lr" not in sweep.constants


def test_a_top_level_key_added_since_an_old_run_reads_as_its_default_not_as_a_dimension() -> None:
    """A run of an older attnlab has no ``compile`` key: it ran eagerly, as ``compile: false`` says; a key
    without a default (or nested) still reads as missing."""
    old, new, compiled = make_run({"lr": 1e-3}), make_run({"lr": 3e-3}), make_run({"lr": 1e-2})
    old.config.pop("compile", None)
    new.config["compile"], compiled.config["compile"] = False, True
    assert old.value("compile") is False and old.value("no_such_key") == MISSING
    assert dim_keys(Sweep([old, new])) == ["lr"] and Sweep([old, new]).constants["compile"] is False
    assert sorted(dim_keys(Sweep([old, new, compiled]))) == ["compile", "lr"]


def test_seeds_and_bookkeeping_are_replicates_never_a_dimension() -> None:
    runs = []
    for seed in range(4):
        cfg = {
            "threads": seed + 1,
            "logger.project": f"p{seed}",
            "logger.tags": [f"t{seed}"],
            "resume": seed % 2 == 0,
            "diagnostics.every_n_steps": 10 * (seed + 1),
        }
        runs.append(make_run(cfg, seed=seed))
    # the helper's seed also lands in task.datamodule.seed: check that it varies, so the test could fail
    assert len({r.value("task.datamodule.seed") for r in runs}) == 4
    sweep = Sweep(runs)
    assert sweep.dims == []
    for key in ("seed", "task.datamodule.seed", "threads", "logger.project", "logger.tags", "resume"):
        assert key not in sweep.constants
    # with a real setting varying next to them, that setting is the only dimension
    runs += [make_run({"lr": 1e-2, "threads": 7, "logger.project": "q"}, seed=s) for s in range(4)]
    assert dim_keys(Sweep(runs)) == ["lr"]


def test_a_mirror_key_is_dropped_in_favour_of_the_top_level_key() -> None:
    runs = [make_run({"max_steps": m}, seed=s) for m in (100, 300, 1000) for s in range(2)]
    assert [r.value("trainer.max_steps") for r in runs] == [r.value("max_steps") for r in runs]
    sweep = Sweep(runs)
    assert dim_keys(sweep) == ["max_steps"]
    assert sweep.dims[0].name == "max_steps"
    assert sweep.dims[0].values == (100, 300, 1000)


def test_a_group_key_fixed_by_the_variant_name_is_not_a_dimension() -> None:
    dot = [make_run({"variant.name": "dot"}, seed=s) for s in range(2)]
    additive = [
        make_run({"variant.name": "additive", "variant.params.d_attn": 16, "variant.params.chunk_size": None}, seed=s)
        for s in range(2)
    ]
    assert dot[0].value("variant.params.d_attn") == MISSING
    assert additive[0].value("variant.params.d_attn") == 16
    sweep = Sweep(dot + additive)
    assert dim_keys(sweep) == ["variant.name"]
    assert sweep.dims[0].values == ("additive", "dot")


def test_a_group_key_swept_within_one_variant_is_a_dimension() -> None:
    runs = [make_run({"variant.name": "dot"}, seed=s) for s in range(2)]
    for d_attn in (16, 32):
        cfg = {"variant.name": "additive", "variant.params.d_attn": d_attn, "variant.params.chunk_size": None}
        runs += [make_run(cfg, seed=s) for s in range(2)]
    sweep = Sweep(runs)
    assert dim_keys(sweep) == ["variant.name", "variant.params.d_attn"]
    d_attn = sweep.dim("d_attn")
    assert d_attn.name == "d_attn"
    assert d_attn.values == (16, 32, MISSING)
    assert d_attn.numeric
    assert sweep.label(runs[-1], sweep.dims) == "additive · d_attn=32"


def test_pos_encoding_set_by_a_preset_is_derived_not_a_dimension() -> None:
    runs = []
    for variant in ("dot", "scaled_dot", "alibi"):
        pos = "none" if variant == "alibi" else "sinusoidal"
        runs += [make_run({"variant.name": variant, "model.pos_encoding": pos}, seed=s) for s in range(2)]
    sweep = Sweep(runs)
    assert dim_keys(sweep) == ["variant.name"]
    assert sweep.derived == {"model.pos_encoding": "variant.name"}
    assert "model.pos_encoding" not in sweep.constants


def test_a_preset_key_is_derived_in_a_two_variant_sweep_too() -> None:
    """scaled_dot vs alibi: pos_encoding takes as many values as the variant, and still only repeats it."""
    runs = [
        make_run({"variant.name": v, "model.pos_encoding": "none" if v == "alibi" else "sinusoidal"}, seed=s)
        for v in ("scaled_dot", "alibi")
        for s in range(2)
    ]
    sweep = Sweep(runs)
    assert dim_keys(sweep) == ["variant.name"] and sweep.derived == {"model.pos_encoding": "variant.name"}


def test_a_key_set_on_the_command_line_is_a_dimension_even_when_it_follows_the_variant() -> None:
    """An Optuna search over variant and d_k whose few trials happen to pair each variant with one d_k."""
    runs = []
    for variant, d_k in (("dot", 8), ("additive", 16), ("scaled_dot", 16), ("dot", 8)):
        run = make_run({"variant.name": variant, "d_k": d_k})
        run.summary["overrides"] = [f"variant={variant}", f"d_k={d_k}"]
        runs.append(run)
    sweep = Sweep(runs)
    assert dim_keys(sweep) == ["variant.name", "d_k"] and sweep.derived == {}
    for run in runs:  # the same runs without their command lines: d_k only repeats the variant
        run.summary["overrides"] = []
    assert dim_keys(Sweep(runs)) == ["variant.name"] and Sweep(runs).derived == {"d_k": "variant.name"}


def test_a_mirror_of_a_derived_key_is_not_listed_twice() -> None:
    """Task presets set max_steps (and so trainer.max_steps): one derived entry, not two."""
    runs = [
        make_run({"task.name": task, "max_steps": steps}, seed=s)
        for task, steps in (("digits", 300), ("sort", 1000), ("reverse", 1000))
        for s in range(2)
    ]
    sweep = Sweep(runs)
    assert dim_keys(sweep) == ["task.name"] and sweep.derived == {"max_steps": "task.name"}


def test_an_optuna_search_keeps_both_lr_and_d_k() -> None:
    rng = np.random.default_rng(11)
    n = 9
    d_ks = [8, 16, 32] * 3
    rng.shuffle(d_ks)
    lrs = 10 ** rng.uniform(-4, -2, size=n)
    runs = [make_run({"lr": float(lr), "d_k": int(d_k)}, seed=0) for lr, d_k in zip(lrs, d_ks, strict=True)]
    sweep = Sweep(runs)
    assert dim_keys(sweep) == ["d_k", "lr"]
    assert sweep.dim("d_k").values == (8, 16, 32)
    assert sweep.dim("lr").values == tuple(sorted(float(x) for x in lrs))
    assert sweep.derived == {}
    # one trial per d_k: lr is then a function of d_k, and still both stay
    few = [make_run({"lr": float(lrs[i]), "d_k": d_k}) for i, d_k in enumerate((8, 16, 32))]
    assert dim_keys(Sweep(few)) == ["d_k", "lr"]


def test_display_names_are_short() -> None:
    cfgs = factorial(
        **{"variant.name": ["dot", "additive"], "num_heads": [1, 4], "num_layers": [1, 2], "lr": [1e-3, 1e-2]}
    )
    sweep = Sweep([make_run(c) for c in cfgs])
    names = {d.key: d.name for d in sweep.dims}
    assert names == {"variant.name": "variant", "num_heads": "heads", "num_layers": "layers", "lr": "lr"}
    assert sweep.dim("variant").label("dot") == "dot"
    assert sweep.dim("heads").label(4) == "heads=4"
    assert sweep.dim("lr").label(0.001) == "lr=0.001"


def test_dimensions_come_in_a_fixed_order_then_alphabetically() -> None:
    # dict order of the overrides is deliberately the reverse of the expected order
    cfgs = factorial(
        **{
            "model.dropout": [0.0, 0.1],
            "lr": [1e-3, 1e-2],
            "num_heads": [1, 2],
            "d_k": [8, 16],
            "variant.name": ["dot", "additive"],
            "model.d_ff": [128, 256],
        }
    )
    sweep = Sweep([make_run(c) for c in cfgs])
    assert dim_keys(sweep) == ["variant.name", "d_k", "num_heads", "lr", "model.d_ff", "model.dropout"]


def test_numeric_and_log_flags_follow_the_values() -> None:
    cfgs = factorial(
        **{
            "variant.name": ["dot", "additive"],
            "d_k": [8, 64, 512],
            "num_heads": [1, 2, 4],
            "lr": [1e-4, 1e-3, 1e-2],
            "batch_size": [16, 32],
        }
    )
    sweep = Sweep([make_run(c) for c in cfgs])
    flags = {d.name: (d.numeric, d.log) for d in sweep.dims}
    assert flags == {
        "variant": (False, False),
        "d_k": (True, True),
        "heads": (True, False),
        "lr": (True, True),
        "batch": (True, False),
    }


def _four_dim_sweep(sizes: dict[str, int]) -> tuple[Sweep, list[Run]]:
    values = {
        "variant.name": ["additive", "dot", "scaled_dot", "cosine", "general"][: sizes["variant.name"]],
        "d_k": [8, 16, 32, 64, 128][: sizes["d_k"]],
        "num_heads": [1, 2, 4, 8, 16][: sizes["num_heads"]],
        "lr": [1e-4, 3e-4, 1e-3, 3e-3, 1e-2][: sizes["lr"]],
    }
    runs = [make_run(c) for c in factorial(**values)]
    return Sweep(runs), runs


def test_main_dim_is_the_first_numeric_dimension_or_the_named_one() -> None:
    sweep, _ = _four_dim_sweep({"variant.name": 2, "d_k": 2, "num_heads": 2, "lr": 2})
    assert sweep.main_dim().key == "d_k"
    assert sweep.main_dim("lr").key == "lr"
    assert sweep.main_dim("heads").key == "num_heads"
    assert sweep.main_dim("num_heads").key == "num_heads"
    only_variant = Sweep([make_run({"variant.name": v}) for v in ("dot", "additive")])
    assert only_variant.main_dim() is None


def test_an_unknown_dimension_name_raises_and_names_the_varying_keys() -> None:
    sweep, _ = _four_dim_sweep({"variant.name": 2, "d_k": 2, "num_heads": 2, "lr": 2})
    with pytest.raises(ValueError) as caught:
        sweep.main_dim("dropout")
    message = str(caught.value)
    assert "dropout" in message
    for name in ("variant", "d_k", "heads", "lr"):
        assert name in message
    with pytest.raises(ValueError):
        sweep.facet_dim(sweep.main_dim(), "dropout")


def test_facet_dim_is_the_non_first_non_x_dimension_with_fewest_values() -> None:
    # variant (first, the colour) has the fewest values but is never the facet; x = d_k; heads 3 vs lr 2 -> lr
    sweep, _ = _four_dim_sweep({"variant.name": 2, "d_k": 4, "num_heads": 3, "lr": 2})
    x = sweep.main_dim()
    assert x.key == "d_k"
    assert sweep.facet_dim(x).key == "lr"
    # with heads now the fewest (2 vs 3), heads
    sweep, _ = _four_dim_sweep({"variant.name": 2, "d_k": 2, "num_heads": 2, "lr": 3})
    assert sweep.facet_dim(sweep.main_dim()).key == "num_heads"
    # x = lr: the remaining non-first ones are d_k (4) and heads (3) -> heads
    sweep, _ = _four_dim_sweep({"variant.name": 2, "d_k": 4, "num_heads": 3, "lr": 2})
    assert sweep.facet_dim(sweep.dim("lr")).key == "num_heads"
    assert sweep.facet_dim(sweep.main_dim(), "none") is None
    assert sweep.facet_dim(sweep.main_dim(), "heads").key == "num_heads"


def test_facet_dim_needs_two_to_four_values() -> None:
    sweep, _ = _four_dim_sweep({"variant.name": 2, "d_k": 2, "num_heads": 5, "lr": 5})
    assert sweep.facet_dim(sweep.main_dim()) is None
    runs = [make_run(c) for c in factorial(**{"variant.name": ["dot", "additive"], "d_k": [8, 16]})]
    sweep = Sweep(runs)  # no third dimension at all
    assert sweep.facet_dim(sweep.main_dim()) is None


# ---------------------------------------------------------------------------------------------------- mean_ci
def test_mean_ci_matches_the_textbook_t_interval() -> None:
    rng = np.random.default_rng(1)
    for n in range(2, 7):
        for _ in range(5):
            values = [float(v) for v in rng.normal(rng.uniform(-2, 2), rng.uniform(0.01, 3), size=n)]
            mean = sum(values) / n
            s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
            half = float(student_t.ppf(0.975, n - 1)) * s / math.sqrt(n)
            got_mean, got_half, got_n = mean_ci(values)
            assert got_n == n
            assert got_mean == pytest.approx(mean, rel=1e-12, abs=1e-12)
            assert got_half == pytest.approx(half, rel=1e-9)


def test_mean_ci_of_one_value_has_no_interval() -> None:
    value = float(np.random.default_rng(2).uniform())
    assert mean_ci([value]) == (pytest.approx(value), None, 1)
    mean, half, n = mean_ci([None, float("nan"), value])
    assert (mean, half, n) == (pytest.approx(value), None, 1)
    mean, half, n = mean_ci([])
    assert math.isnan(mean) and half is None and n == 0


def test_mean_ci_ignores_nan_none_and_inf() -> None:
    rng = np.random.default_rng(3)
    values = [float(v) for v in rng.uniform(0, 1, size=4)]
    noisy = [None, values[0], float("nan"), values[1], float("inf"), values[2], None, values[3], float("-inf")]
    mean, half, n = mean_ci(noisy)
    hand_mean, hand_half, hand_n = hand_ci(values)
    assert n == hand_n == 4
    assert mean == pytest.approx(hand_mean, rel=1e-12)
    assert half == pytest.approx(hand_half, rel=1e-9)


def test_t_critical_matches_printed_tables_to_full_precision() -> None:
    """scipy's quantiles (issue 40: the hand-written table and its expansion are gone) against values written here,
    not computed by scipy: the closed forms for 1 and 2 degrees of freedom (Cauchy: tan(0.475 pi); df = 2:
    (2p - 1) / sqrt(2p(1 - p)) = 4.3026527297...), and t_{0.975, df} as printed to 10 digits (NIST/SEMATECH
    e-Handbook of Statistical Methods, table 1.3.6.7.2)."""
    assert t_critical(1) == pytest.approx(12.706204736174696, rel=1e-12)
    assert t_critical(2) == pytest.approx(4.302652729749464, rel=1e-12)
    for df, printed in ((3, 3.182446305), (4, 2.776445105), (5, 2.570581836), (10, 2.228138852), (30, 2.042272456)):
        assert t_critical(df) == pytest.approx(printed, abs=1e-9), df
    assert t_critical(120) == pytest.approx(1.979930405, abs=1e-9)
    assert "use_scipy" not in inspect.signature(t_critical).parameters  # no fallback left to disagree with scipy
    assert not hasattr(stats_module, "_betainc") and not hasattr(stats_module, "_T975")
    with pytest.raises(ValueError):
        t_critical(0)


# ---------------------------------------------------------------------------------------------------- aggregate
def test_aggregate_pools_seeds_per_series_and_x_and_skips_failed_runs() -> None:
    rng = np.random.default_rng(4)
    expected: dict[tuple[str, int], list[float]] = {}
    runs = []
    for variant in ("dot", "additive"):
        for d_k in (16, 32, 64):
            n = int(rng.integers(1, 5))
            for seed in range(n):
                value = float(rng.uniform(0.5, 0.95))
                expected.setdefault((variant, d_k), []).append(value)
                runs.append(make_run({"variant.name": variant, "d_k": d_k}, seed=seed, metrics={"test/acc": value}))
            # a failed run with an outlying value in every configuration
            runs.append(
                make_run({"variant.name": variant, "d_k": d_k}, seed=99, status="failed", metrics={"test/acc": 0.0})
            )
    # a configuration that only failed: it has no point
    runs.append(make_run({"variant.name": "dot", "d_k": 128}, seed=0, status="failed", metrics={"test/acc": 0.1}))
    rng.shuffle(runs)
    sweep = Sweep(runs)
    x, variant_dim = sweep.dim("d_k"), sweep.dim("variant")
    series = aggregate(runs, sweep, "test/acc", x, [variant_dim])
    assert [s.label for s in series] == ["additive", "dot"]
    assert [s.key for s in series] == [("additive",), ("dot",)]
    for s in series:
        variant = s.key[0]
        assert [p.x for p in s.points] == [16.0, 32.0, 64.0]
        for p in s.points:
            values = expected[variant, int(p.x)]
            mean, half, n = hand_ci(values)
            assert p.n == n
            assert sorted(p.values) == sorted(values)
            assert p.mean == pytest.approx(mean, rel=1e-12)
            if half is None:
                assert p.half_width is None
            else:
                assert p.half_width == pytest.approx(half, rel=1e-9)


def test_aggregate_without_series_dims_pools_every_configuration_at_each_x() -> None:
    rng = np.random.default_rng(5)
    by_x: dict[int, list[float]] = {}
    runs = []
    for variant in ("dot", "additive"):
        for d_k in (8, 64):
            for seed in range(3):
                value = float(rng.uniform(0.3, 0.9))
                by_x.setdefault(d_k, []).append(value)
                runs.append(make_run({"variant.name": variant, "d_k": d_k}, seed=seed, metrics={"test/acc": value}))
    sweep = Sweep(runs)
    (only,) = aggregate(runs, sweep, "test/acc", sweep.dim("d_k"), [])
    assert only.label == "all runs"
    assert [p.x for p in only.points] == [8.0, 64.0]
    for p in only.points:
        mean, half, n = hand_ci(by_x[int(p.x)])
        assert (p.n, p.mean, p.half_width) == (n, pytest.approx(mean), pytest.approx(half))


def test_aggregate_uses_the_value_index_for_a_categorical_x() -> None:
    rng = np.random.default_rng(6)
    runs, by_variant = [], {}
    for variant in ("general", "dot", "additive"):
        for seed in range(2):
            value = float(rng.uniform())
            by_variant.setdefault(variant, []).append(value)
            runs.append(make_run({"variant.name": variant}, seed=seed, metrics={"test/acc": value}))
    sweep = Sweep(runs)
    (only,) = aggregate(runs, sweep, "test/acc", sweep.dim("variant"), [])
    ordered = sorted(by_variant)  # additive, dot, general
    assert [p.x for p in only.points] == [0.0, 1.0, 2.0]
    for p in only.points:
        assert p.mean == pytest.approx(hand_ci(by_variant[ordered[int(p.x)]])[0])


def test_point_interval_clips_to_the_metric_range() -> None:
    acc = spec_for("test/acc")
    assert Point(x=0.0, mean=0.98, half_width=0.05, n=3, values=()).interval(acc) == (pytest.approx(0.93), 1.0)
    assert Point(x=0.0, mean=0.02, half_width=0.05, n=3, values=()).interval(acc) == (0.0, pytest.approx(0.07))
    assert Point(x=0.0, mean=0.5, half_width=0.1, n=3, values=()).interval(acc) == (
        pytest.approx(0.4),
        pytest.approx(0.6),
    )
    loss = spec_for("test/loss")
    assert Point(x=0.0, mean=0.1, half_width=0.3, n=3, values=()).interval(loss) == (0.0, pytest.approx(0.4))
    assert Point(x=0.0, mean=5.0, half_width=0.5, n=3, values=()).interval(loss) == (4.5, 5.5)
    assert Point(x=0.0, mean=0.5, half_width=None, n=1, values=(0.5,)).interval(acc) is None


# ---------------------------------------------------------------------------------------------------- headline
def _headline_runs(metric: str, low: float, high: float, rng: np.random.Generator, failed_value: float):
    """variant x heads x d_k, 1 to 4 seeds each, plus a failed run per configuration with ``failed_value``."""
    expected: dict[tuple[tuple[str, int], int], list[float]] = {}
    params = {"dot": 1000, "additive": 2000, "general": 3000}
    runs = []
    for variant in ("dot", "additive", "general"):
        for heads in (1, 2):
            for d_k in (16, 32):
                cfg = {"variant.name": variant, "num_heads": heads, "d_k": d_k}
                for seed in range(int(rng.integers(1, 5))):
                    value = float(rng.uniform(low, high))
                    expected.setdefault(((variant, heads), d_k), []).append(value)
                    runs.append(make_run(cfg, seed=seed, metrics={metric: value}, params=params[variant] + heads))
                runs.append(make_run(cfg, seed=50, status="failed", metrics={metric: failed_value}))
    rng.shuffle(runs)
    return runs, expected, params


@pytest.mark.parametrize(("metric", "higher"), [("test/acc", True), ("test/loss", False)])
def test_headline_cells_and_best_per_column_match_hand_computation(metric: str, higher: bool) -> None:
    rng = np.random.default_rng(7 if higher else 8)
    low, high = (0.4, 0.95) if higher else (0.1, 2.0)
    # a failed run with a value that would win the column if it were counted
    runs, expected, params = _headline_runs(metric, low, high, rng, failed_value=1.0 if higher else 0.0)
    sweep = Sweep(runs)
    column = sweep.dim("d_k")
    table = headline(runs, sweep, metric, column)
    assert table.columns == [16, 32]
    assert [key for _, key in table.rows] == [(v, h) for v in ("additive", "dot", "general") for h in (1, 2)]
    assert [label for label, _ in table.rows] == [
        f"{v} · heads={h}" for v in ("additive", "dot", "general") for h in (1, 2)
    ]
    assert set(table.cells) == set(expected)
    for (row, col), values in expected.items():
        mean, half, n = hand_ci(values)
        cell = table.cells[row, col]
        assert cell.n == n
        assert cell.mean == pytest.approx(mean, rel=1e-12)
        assert (cell.half_width is None) == (half is None)
        if half is not None:
            assert cell.half_width == pytest.approx(half, rel=1e-9)
        assert cell.params == (params[row[0]] + row[1],)
    for col in (16, 32):
        best_row, best_mean = None, None
        for (row, c), values in expected.items():
            if c != col:
                continue
            mean = sum(values) / len(values)
            if best_mean is None or (mean > best_mean if higher else mean < best_mean):
                best_row, best_mean = row, mean
        assert table.best[col] == best_row


def test_headline_without_a_column_has_one_column_of_every_configuration() -> None:
    rng = np.random.default_rng(9)
    runs, expected = [], {}
    for variant in ("dot", "additive"):
        for seed in range(3):
            value = float(rng.uniform(0.5, 0.9))
            expected.setdefault(variant, []).append(value)
            runs.append(make_run({"variant.name": variant}, seed=seed, metrics={"test/acc": value}))
    sweep = Sweep(runs)
    table = headline(runs, sweep, "test/acc", None)
    assert table.columns == [None]
    assert sorted(table.cells) == [(("additive",), None), (("dot",), None)]
    for variant, values in expected.items():
        assert table.cells[(variant,), None].mean == pytest.approx(sum(values) / len(values))


def _two_configs(winner: list[float], runner: list[float], metric: str = "test/acc") -> tuple[Sweep, list[Run]]:
    runs = [make_run({"variant.name": "dot"}, seed=s, metrics={metric: v}) for s, v in enumerate(winner)]
    runs += [make_run({"variant.name": "additive"}, seed=s, metrics={metric: v}) for s, v in enumerate(runner)]
    return Sweep(runs), runs


def test_sentence_names_winner_runner_up_margin_and_the_paired_verdict() -> None:
    sweep, runs = _two_configs([0.90, 0.91, 0.92], [0.85, 0.86, 0.87])
    text = headline(runs, sweep, "test/acc", None).sentence()
    assert text.startswith("Best test/acc: dot")
    assert "Runner-up: additive" in text
    assert "5.0 points behind" in text
    # the differences are 0.05 on every seed: no spread, so the paired test rejects (p = 0)
    assert "Paired t over 3 seeds, Holm-corrected over 1 comparison: it beats the other" in text


def test_sentence_margin_and_paired_verdict_match_hand_computation() -> None:
    """Two draws: a gap far above the seed noise (beats), and one within it (not separated); the verdict follows
    the paired t test computed here by hand, not the overlap of the two intervals."""
    rng = np.random.default_rng(11)
    for gap, spread, separated in ((0.04, 0.001, True), (0.01, 0.05, False)):
        a = [float(v) for v in 0.80 + rng.normal(0, spread, size=3)]
        b = [float(v) - gap + float(e) for v, e in zip(a, rng.normal(0, spread, size=3), strict=True)]
        ma, mb = sum(a) / 3, sum(b) / 3
        mean, half, p, _ = hand_paired(dict(enumerate(a)), dict(enumerate(b)))
        assert (p < 0.05) is separated  # the draw does what the test needs
        winner, loser = ("dot", "additive") if ma > mb else ("additive", "dot")
        sweep, runs = _two_configs(a, b)
        table = headline(runs, sweep, "test/acc", None)
        text = table.sentence()
        assert text.startswith(f"Best test/acc: {winner}")
        assert f"Runner-up: {loser}" in text
        assert f"{100 * abs(ma - mb):.1f} points behind" in text
        (comp,) = table.comparisons()
        sign = 1 if winner == "dot" else -1
        assert comp.difference.mean == pytest.approx(sign * mean, rel=1e-9)
        assert comp.difference.half_width == pytest.approx(half, rel=1e-9)
        assert comp.difference.p == pytest.approx(p, rel=1e-6) and comp.p_holm == pytest.approx(p, rel=1e-6)
        if separated:
            assert "it beats the other" in text and comp.wins
        else:
            assert f"; not {loser} (adjusted p = {p:.2g}): within seed noise" in text and not comp.wins


def test_sentence_says_one_seed_when_there_is_no_interval() -> None:
    sweep, runs = _two_configs([0.9], [0.8])
    text = headline(runs, sweep, "test/acc", None).sentence()
    assert "With one seed there is no interval, so the margins are untested" in text
    assert "Holm" not in text
    assert "10.0 points behind" in text


def test_sentence_for_a_loss_names_the_lowest_mean() -> None:
    sweep, runs = _two_configs([1.5, 1.6, 1.7], [0.5, 0.6, 0.7], metric="test/loss")
    table = headline(runs, sweep, "test/loss", None)
    text = table.sentence()
    assert text.startswith("Best test/loss: additive")
    assert "Runner-up: dot" in text
    assert "points" not in text
    assert f"{1.6 - 0.6:.3g} behind" in text
    assert table.best[None] == ("additive",)


def test_sentence_runner_up_is_at_the_winners_column() -> None:
    # dot wins at d_k=32 (0.95); additive's best is 0.93 at d_k=16, but at d_k=32 it has 0.80
    values = {("dot", 16): 0.70, ("dot", 32): 0.95, ("additive", 16): 0.93, ("additive", 32): 0.80}
    runs = []
    for (variant, d_k), v in values.items():
        runs += [make_run({"variant.name": variant, "d_k": d_k}, seed=s, metrics={"test/acc": v}) for s in range(2)]
    sweep = Sweep(runs)
    text = headline(runs, sweep, "test/acc", sweep.dim("d_k")).sentence()
    assert text.startswith("Best test/acc: dot at d_k=32")
    assert "Runner-up: additive" in text
    assert f"{100 * (0.95 - 0.80):.1f} points behind" in text


def test_sentence_says_the_winner_is_best_at_every_column_value() -> None:
    rng = np.random.default_rng(17)

    def runs_where(additive_wins_at: int | None) -> list[Run]:
        runs = []
        for d_k in (16, 32, 64):
            for seed in range(2):
                good, bad = float(rng.uniform(0.85, 0.95)), float(rng.uniform(0.40, 0.60))
                dot, additive = (bad, good) if d_k == additive_wins_at else (good, bad)
                runs.append(make_run({"variant.name": "dot", "d_k": d_k}, seed=seed, metrics={"test/acc": dot}))
                runs.append(
                    make_run({"variant.name": "additive", "d_k": d_k}, seed=seed, metrics={"test/acc": additive})
                )
        return runs

    runs = runs_where(None)
    sweep = Sweep(runs)
    table = headline(runs, sweep, "test/acc", sweep.dim("d_k"))
    assert table.best == {16: ("dot",), 32: ("dot",), 64: ("dot",)}
    assert "It is best at every d_k." in table.sentence()
    # once additive wins one column, the claim goes
    runs = runs_where(64)
    sweep = Sweep(runs)
    table = headline(runs, sweep, "test/acc", sweep.dim("d_k"))
    assert table.best == {16: ("dot",), 32: ("dot",), 64: ("additive",)}
    assert "best at every" not in table.sentence()


def test_headline_skips_runs_without_the_metric_and_names_no_winner_without_a_direction() -> None:
    rng = np.random.default_rng(18)
    runs = []
    for variant in ("dot", "additive"):
        for seed in range(2):
            values = {"test/acc": float(rng.uniform()), "attn/saturation": float(rng.uniform())}
            runs.append(make_run({"variant.name": variant}, seed=seed, metrics=values))
    runs += [make_run({"variant.name": "general"}, seed=s, metrics={}) for s in range(2)]
    sweep = Sweep(runs)
    table = headline(runs, sweep, "test/acc", None)
    assert [key for _, key in table.rows] == [("additive",), ("dot",)]
    diag = headline(runs, sweep, "attn/saturation", None)
    assert diag.best == {} and diag.winner() is None
    assert diag.sentence() == "attn/saturation has no better direction, so no winner is named."
    assert headline(runs, sweep, "test/nothing", None).sentence() == "No finished run reports test/nothing."


# ---------------------------------------------------------------------------------------------------- curves
def _rows(steps: list[int], values: list[float | None], metric: str) -> list[dict[str, Any]]:
    return [{"step": s, metric: v} for s, v in zip(steps, values, strict=True)]


def test_curves_mean_and_band_per_step_match_hand_computation() -> None:
    rng = np.random.default_rng(12)
    metric = "train/loss"
    steps = list(range(0, 100, 10))
    by_variant: dict[str, dict[int, list[float]]] = {}
    runs = []
    for variant in ("dot", "additive"):
        for seed in range(3):
            values: list[float | None] = [float(v) for v in rng.uniform(0.2, 2.5, size=len(steps))]
            run_steps = list(steps)
            if seed == 1:
                values[2] = None  # a null in the log
                values[5] = float("nan")
                run_steps, values = run_steps[:-1], values[:-1]  # and a shorter run
            for s, v in zip(run_steps, values, strict=True):
                if v is not None and math.isfinite(v):
                    by_variant.setdefault(variant, {}).setdefault(s, []).append(v)
            runs.append(make_run({"variant.name": variant}, seed=seed, rows=_rows(run_steps, values, metric)))
    sweep = Sweep(runs)
    found = curves(runs, sweep, metric, [sweep.dim("variant")])
    assert [c.label for c in found] == ["additive", "dot"]
    for curve in found:
        at = by_variant[curve.key[0]]
        assert curve.steps.tolist() == [float(s) for s in sorted(at)]
        for i, s in enumerate(sorted(at)):
            mean, half, n = hand_ci(at[s])
            assert curve.n[i] == n
            assert curve.mean[i] == pytest.approx(mean, rel=1e-12)
            if half is None:
                assert math.isnan(curve.low[i]) and math.isnan(curve.high[i])
            else:
                assert curve.low[i] == pytest.approx(max(mean - half, 0.0), rel=1e-9, abs=1e-12)
                assert curve.high[i] == pytest.approx(mean + half, rel=1e-9)
        assert curve.n.tolist()[2] == 2 and curve.n.tolist()[-1] == 2


def test_curves_include_failed_runs() -> None:
    rng = np.random.default_rng(19)
    ok_values = [float(v) for v in rng.uniform(1, 2, size=4)]
    failed_values = [float(v) for v in rng.uniform(5, 9, size=2)]  # diverged, then crashed after step 1
    runs = [
        make_run({}, seed=0, rows=_rows([0, 1, 2, 3], ok_values, "train/loss")),
        make_run({}, seed=1, status="failed", rows=_rows([0, 1], failed_values, "train/loss")),
    ]
    (curve,) = curves(runs, Sweep(runs), "train/loss", [])
    assert curve.n.tolist() == [2, 2, 1, 1]
    assert curve.mean.tolist() == pytest.approx(
        [(ok_values[0] + failed_values[0]) / 2, (ok_values[1] + failed_values[1]) / 2, ok_values[2], ok_values[3]]
    )


def test_curves_band_is_clipped_to_the_unit_range_for_accuracy() -> None:
    rng = np.random.default_rng(13)
    steps = list(range(5))
    per_step: dict[int, list[float]] = {}
    runs = []
    for seed in range(2):
        values = [float(v) for v in rng.uniform(0.5, 1.0, size=len(steps))]
        for s, v in zip(steps, values, strict=True):
            per_step.setdefault(s, []).append(v)
        runs.append(make_run({}, seed=seed, rows=_rows(steps, values, "val/acc")))
    sweep = Sweep(runs)
    (curve,) = curves(runs, sweep, "val/acc", [])
    clipped_somewhere = False
    for i, s in enumerate(steps):
        mean, half, _ = hand_ci(per_step[s])
        assert curve.low[i] == pytest.approx(max(mean - half, 0.0))
        assert curve.high[i] == pytest.approx(min(mean + half, 1.0))
        clipped_somewhere |= mean + half > 1.0 or mean - half < 0.0
    assert clipped_somewhere  # two seeds of a wide uniform: t_{0.975,1} = 12.7 makes the band leave [0, 1]


def test_curves_with_one_seed_have_a_nan_band() -> None:
    values = [float(v) for v in np.random.default_rng(14).uniform(1, 2, size=6)]
    run = make_run({}, rows=_rows(list(range(0, 60, 10)), values, "train/loss"))
    (curve,) = curves([run], Sweep([run]), "train/loss", [])
    assert curve.mean.tolist() == pytest.approx(values)
    assert np.isnan(curve.low).all() and np.isnan(curve.high).all()
    assert curve.n.tolist() == [1] * 6


def test_curves_thinning_keeps_first_and_last_step() -> None:
    rng = np.random.default_rng(15)
    steps = [5 * i for i in range(457)]
    values = [float(v) for v in rng.uniform(0, 3, size=len(steps))]
    run = make_run({}, rows=_rows(steps, values, "train/loss"))
    (curve,) = curves([run], Sweep([run]), "train/loss", [])
    kept = curve.steps.tolist()
    assert 2 <= len(kept) <= MAX_CURVE_POINTS == 200
    assert kept[0] == 0.0 and kept[-1] == float(steps[-1])
    assert kept == sorted(set(kept))
    value_at = dict(zip(steps, values, strict=True))
    for s, m in zip(kept, curve.mean.tolist(), strict=True):
        assert s in value_at
        assert m == pytest.approx(value_at[int(s)])
    # exactly 200 steps are not thinned
    run = make_run({}, rows=_rows(list(range(200)), values[:200], "train/loss"))
    (curve,) = curves([run], Sweep([run]), "train/loss", [])
    assert curve.steps.tolist() == [float(s) for s in range(200)]


# ---------------------------------------------------------------------------------------------------- best_runs
def test_best_runs_orders_by_the_metrics_direction_and_skips_failed_runs() -> None:
    rng = np.random.default_rng(16)
    runs = []
    for metric in ("test/acc", "test/loss"):
        runs.clear()
        for variant in ("dot", "additive"):
            for seed in range(4):
                runs.append(make_run({"variant.name": variant}, seed=seed, metrics={metric: float(rng.uniform())}))
            runs.append(make_run({"variant.name": variant}, seed=9, status="failed", metrics={metric: 0.5}))
            runs.append(make_run({"variant.name": variant}, seed=10, metrics={}))  # no value
        grouped = best_runs(runs, metric, lambda r: r.variant)
        assert sorted(grouped) == ["additive", "dot"]
        for variant, members in grouped.items():
            assert len(members) == 4
            finals = [r.summary["metrics"][metric] for r in members]
            assert finals == sorted(finals, reverse=metric == "test/acc")
            assert all(r.ok and r.variant == variant for r in members)


# ---------------------------------------------------------------------------------------------------- metrics
def test_parse_metric_splits_length_head_and_layer_names() -> None:
    assert parse_metric("test/acc@64") == ("length", "test/acc", {"length": 64})
    assert parse_metric("val/loss@1024") == ("length", "val/loss", {"length": 1024})
    assert parse_metric("attn/L1H0/saturation") == ("head", "attn/saturation", {"layer": 1, "head": 0})
    assert parse_metric("attn/L12H7/entropy_norm") == ("head", "attn/entropy_norm", {"layer": 12, "head": 7})
    assert parse_metric("attn/L3/entropy_norm") == ("layer", "attn/entropy_norm", {"layer": 3})
    assert parse_metric("test/acc") == ("scalar", "test/acc", {})
    assert parse_metric("attn/saturation") == ("scalar", "attn/saturation", {})
    assert parse_metric("test/acc@") == ("scalar", "test/acc@", {})


def test_spec_for_accuracies_is_a_percentage_where_higher_is_better() -> None:
    for name in ("val/acc_best", "test/acc@64", "test/acc", "train/acc"):
        spec = spec_for(name)
        assert spec.percent, name
        assert spec.higher_is_better is True, name
        assert (spec.low, spec.high) == (0.0, 1.0), name
        assert spec.format_margin(0.05) == "5.0 points"


def test_spec_for_loss_and_bpc_is_lower_is_better() -> None:
    for name in ("test/loss", "train/loss", "val/loss@128", "test/bpc"):
        spec = spec_for(name)
        assert spec.higher_is_better is False, name
        assert not spec.percent, name
        assert spec.low == 0.0 and spec.high is None, name


def test_spec_for_attention_fractions_is_the_unit_range_without_a_direction() -> None:
    for name in ("attn/saturation", "attn/L1H0/saturation", "attn/L0/saturation", "attn/entropy_norm"):
        spec = spec_for(name)
        assert (spec.low, spec.high) == (0.0, 1.0), name
        assert spec.higher_is_better is None, name
    assert spec_for("attn/saturation").title != spec_for("attn/entropy_norm").title


def test_an_unknown_metric_gets_the_catch_all_spec() -> None:
    spec = spec_for("my/odd_metric")
    assert spec == MetricSpec(title="value")
    assert spec_for("foo") == MetricSpec(title="value")


def test_a_registered_metric_takes_precedence_over_the_built_in_families() -> None:
    before = list(core_stats._FAMILIES)
    assert spec_for("test/acc").title == "accuracy"
    made = None
    try:
        made = register_metric(r"test/acc", "my accuracy", unit="ratio", higher_is_better=False)
        assert spec_for("test/acc") is made
        assert spec_for("test/acc@64") is made
        assert spec_for("val/acc").title == "accuracy"  # the pattern is matched in full
    finally:
        core_stats._FAMILIES[:] = [f for f in core_stats._FAMILIES if made is None or f[1] is not made]
    assert core_stats._FAMILIES == before
    assert spec_for("test/acc").title == "accuracy"


def test_a_tie_is_named_as_a_tie_and_every_tied_cell_is_marked_best() -> None:
    runs = [
        make_run({"variant.name": variant}, seed=seed, metrics={"test/acc": 0.5 + 0.1 * seed})
        for variant in ("dot", "scaled_dot", "additive")
        for seed in range(2)
    ]
    runs[-1].summary["metrics"]["test/acc"] = 0.1  # additive is worse
    sweep = Sweep(runs)
    table = headline(runs, sweep, "test/acc", None)
    sentence = table.sentence()
    assert sentence.startswith("Best test/acc: dot, 55.0 %") and "Tied with scaled_dot, 55.0 %" in sentence
    marked = [label for label, key in table.rows if table.is_best(key, None)]
    assert marked == ["dot", "scaled_dot"]


# ---------------------------------------------------------------------------------------------------- paired, Holm
def test_paired_difference_pairs_on_the_common_seeds_by_hand() -> None:
    """Unequal seed sets: a ran seeds 0-3, b seeds 1-4; only 1, 2, 3 pair (a's seed 0 and b's seed 4 are out)."""
    a = {0: 0.70, 1: 0.81, 2: 0.86, 3: 0.90}
    b = {1: 0.78, 2: 0.80, 3: 0.87, 4: 0.10}
    mean, half, p, n = hand_paired(a, b)
    assert n == 3 and mean == pytest.approx(((0.81 - 0.78) + (0.86 - 0.80) + (0.90 - 0.87)) / 3)
    d = paired_difference(a, b)
    assert d.paired and d.n == 3 and d.df == 2
    assert d.mean == pytest.approx(mean, rel=1e-12)
    assert d.half_width == pytest.approx(half, rel=1e-9)
    # t_{0.975, 2} from a printed table: the half-width is 4.303 s_d / sqrt(3)
    diffs = [0.03, 0.06, 0.03]
    s_d = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 2)
    assert d.half_width == pytest.approx(4.302653 * s_d / math.sqrt(3), rel=1e-6)
    assert d.p == pytest.approx(p, rel=1e-9)
    assert d.t == pytest.approx(mean / (s_d / math.sqrt(3)), rel=1e-9)
    # one common seed: a difference, no interval, no test
    one = paired_difference({0: 0.9, 1: 0.8}, {1: 0.5, 2: 0.4})
    assert (one.mean, one.half_width, one.p, one.n, one.paired) == (pytest.approx(0.3), None, None, 1, True)
    # no spread in the differences: p = 0 (a real difference) or 1 (none)
    assert paired_difference({0: 0.9, 1: 0.8}, {0: 0.85, 1: 0.75}).p == 0.0
    assert paired_difference({0: 0.9, 1: 0.8}, {0: 0.9, 1: 0.8}).p == 1.0


def test_without_a_common_seed_the_difference_is_welchs() -> None:
    a, b = [0.91, 0.88, 0.95, 0.90], [0.80, 0.86, 0.71]
    mean, half, p, df = hand_welch(a, b)
    d = paired_difference(dict(enumerate(a)), {10 + i: v for i, v in enumerate(b)})
    assert not d.paired and d.n == 7
    assert d.mean == pytest.approx(mean, rel=1e-12)
    assert d.df == pytest.approx(df, rel=1e-12)
    assert d.half_width == pytest.approx(half, rel=1e-9)
    assert d.p == pytest.approx(p, rel=1e-9)
    assert welch_difference(a, b) == d
    assert welch_difference(a, [0.5]).half_width is None and math.isnan(welch_difference([], b).mean)


def test_t_two_sided_p_at_printed_quantiles() -> None:
    """|t| = t_{0.975, df} (printed tables) leaves 5 % in the two tails; t_{0.995, 4} = 4.604094871 leaves 1 %."""
    assert t_two_sided_p(12.706204736174707, 1) == pytest.approx(0.05, rel=1e-10)
    assert t_two_sided_p(-2.776445105197799, 4) == pytest.approx(0.05, rel=1e-10)
    assert t_two_sided_p(4.604094871, 4) == pytest.approx(0.01, rel=1e-8)
    assert t_two_sided_p(0.0, 7) == 1.0
    assert t_two_sided_p(math.inf, 3) == 0.0 and math.isnan(t_two_sided_p(math.nan, 3))
    assert "use_scipy" not in inspect.signature(t_two_sided_p).parameters


def test_holm_adjustment_by_hand() -> None:
    # a textbook example, m = 4: sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> the
    # running maximum 0.02, 0.03, 0.06, 0.06
    p = [0.01, 0.04, 0.03, 0.005]
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm(p) == pytest.approx(hand_holm(p))
    rng = np.random.default_rng(21)
    for m in (1, 2, 5, 9):
        values = [float(v) for v in rng.uniform(0, 0.2, size=m)]
        assert holm(values) == pytest.approx(hand_holm(values))
    assert holm([0.5, 0.6]) == [1.0, 1.0] and holm([]) == []
    assert holm([0.02, 0.02]) == [0.04, 0.04]  # ties


def test_holm_changes_the_verdict_against_uncorrected_tests() -> None:
    """The winner (dot) against three rivals over the same 3 seeds, each rival lower by a paired difference of mean
    m and spread 0.01 (m = 0.0573, 0.0326, 0.0277: two-sided p about 0.01, 0.03, 0.04, each below 0.05 alone).
    Holm multiplies by 3, 2, 1 and carries the maximum: 0.03, 0.06, 0.06, so dot beats only the first."""
    winner = [0.90, 0.91, 0.92]
    margins = {"additive": 0.0573, "general": 0.0326, "cosine": 0.0277}
    runs = [make_run({"variant.name": "dot"}, seed=s, metrics={"test/acc": v}) for s, v in enumerate(winner)]
    hand_p = {}
    for variant, m in margins.items():
        rival = [w - d for w, d in zip(winner, (m - 0.01, m, m + 0.01), strict=True)]
        runs += [make_run({"variant.name": variant}, seed=s, metrics={"test/acc": v}) for s, v in enumerate(rival)]
        hand_p[variant] = hand_paired(dict(enumerate(winner)), dict(enumerate(rival)))[2]
    assert all(p < 0.05 for p in hand_p.values())  # uncorrected: dot "beats" all three
    adjusted = dict(zip(hand_p, hand_holm(list(hand_p.values())), strict=True))
    assert [v for v, p in adjusted.items() if p < 0.05] == ["additive"]  # Holm: only the first
    sweep = Sweep(runs)
    table = headline(runs, sweep, "test/acc", None)
    comps = {c.label: c for c in table.comparisons()}
    assert sorted(comps) == sorted(margins)
    for variant, c in comps.items():
        assert c.difference.p == pytest.approx(hand_p[variant], rel=1e-9)
        assert c.p_holm == pytest.approx(adjusted[variant], rel=1e-9)
        assert c.wins is (variant == "additive")
    text = table.sentence()
    assert "Paired t over 3 seeds, Holm-corrected over 3 comparisons: it beats 1 of the 3 others" in text
    assert f"general (adjusted p = {adjusted['general']:.2g})" in text
    assert f"cosine (adjusted p = {adjusted['cosine']:.2g})" in text


def test_headline_comparisons_with_unequal_seed_sets_and_the_page_table() -> None:
    """The winner ran seeds 0-3; one rival 1-4 (paired over 1, 2, 3), one 7-8 (no common seed: Welch); the page's
    table names the test of each and shows the margin ± half-width, p and the Holm-adjusted p."""
    from attnlab.dashboard.page import _headline_html

    win = {0: 0.95, 1: 0.93, 2: 0.96, 3: 0.94}
    paired = {1: 0.80, 2: 0.85, 3: 0.82, 4: 0.99}
    unpaired = {7: 0.70, 8: 0.76}
    runs = []
    for variant, values in (("dot", win), ("additive", paired), ("general", unpaired)):
        runs += [make_run({"variant.name": variant}, seed=s, metrics={"test/acc": v}) for s, v in values.items()]
    sweep = Sweep(runs)
    table = headline(runs, sweep, "test/acc", None)
    comps = {c.label: c for c in table.comparisons()}
    mean, half, p_paired, n = hand_paired(win, paired)
    assert n == 3 and comps["additive"].difference.paired
    assert comps["additive"].difference.mean == pytest.approx(mean) and comps["additive"].difference.n == 3
    assert comps["additive"].difference.half_width == pytest.approx(half, rel=1e-9)
    w_mean, w_half, p_welch, _ = hand_welch(list(win.values()), list(unpaired.values()))
    assert not comps["general"].difference.paired
    assert comps["general"].difference.mean == pytest.approx(w_mean)
    assert comps["general"].difference.half_width == pytest.approx(w_half, rel=1e-9)
    adjusted = hand_holm([p_paired, p_welch])
    assert [comps["additive"].p_holm, comps["general"].p_holm] == pytest.approx(adjusted, rel=1e-9)
    method = "paired t over 3 seeds and Welch's t for 1 without a common seed, Holm-corrected over 2 comparisons"
    assert table.method() == method
    # the runner-up's margin is the paired one: 12.0 points over seeds 1-3 (the means of all seeds differ by 8.0)
    assert f"{100 * mean:.1f} points behind (± {100 * half:.2g}, paired over 3 seeds)" in table.sentence()
    assert f"{100 * mean:.1f}" == "12.0"
    page = _headline_html(table)
    rivals = page[page.index('<table class="rivals"') :]
    assert "<td>paired, 3 seeds</td>" in rivals.replace(' class="t"', "")
    assert "Welch (no common seed)" in rivals
    assert f"<td>{100 * mean:.1f} ± {100 * half:.2g}</td>" in rivals and "winner − rival (points)" in rivals
    assert f"<td>{p_paired:.2g}</td><td>{adjusted[0]:.2g}</td>" in rivals
    assert "Paired t over 3 seeds and Welch" in rivals  # the caption names the method


# ---------------------------------------------------------------------------------------------------- walk-throughs
def test_half_widths_print_plainly_and_as_more_than_the_range() -> None:
    """Two seeds 20 points apart: t_{0.975,1} = 12.7 makes a half-width of 127 points, printed "± > 100" (wider
    than the whole range), never "1.3e+02"; other half-widths in plain notation."""
    acc, loss = spec_for("test/acc"), spec_for("test/loss")
    half = 12.706204736 * 0.2 / 2  # t_{0.975,1} * s / sqrt(2) with s = 0.2 / sqrt(2)
    assert Cell(0.5, half, 2).half_text(acc) == " ± > 100"
    assert Cell(0.5, 0.0127, 2).half_text(acc) == " ± 1.3"
    assert Cell(0.5, 0.635, 2).half_text(acc) == " ± 64"
    assert Cell(1.0, 123.4, 2).half_text(loss) == " ± 123" and Cell(1.0, 0.01234, 2).half_text(loss) == " ± 0.0123"
    assert Cell(1.0, 1234.5, 2).text(loss) == "1 ± 1234 (n=2)"
    assert spec_for("attn/saturation").format_half(1.5) == "> 1" and Cell(0.5, None, 1).half_text(acc) == ""
    runs = [make_run({"variant.name": "dot"}, seed=s, metrics={"test/acc": v}) for s, v in enumerate([0.4, 0.6])]
    runs += [make_run({"variant.name": "additive"}, seed=s, metrics={"test/acc": 0.3}) for s in range(2)]
    text = headline(runs, Sweep(runs), "test/acc", None).sentence()
    assert "50.0 % ± > 100 (n=2)" in text and "e+" not in text


def test_every_bounded_metric_has_its_bounds_and_intervals_are_clipped_to_them() -> None:
    from attnlab.dashboard.metrics import listed_metrics

    fractions = ("acc", "entropy_norm", "saturation", "max_prob", "support", "first_mass")
    for name in listed_metrics():
        spec = spec_for(name)
        if name == "attn/logit_max":
            assert spec.low is None and spec.high is None  # a logit: any sign
            continue
        assert spec.low == 0.0, name
        if any(name.endswith(f) for f in fractions):
            assert spec.high == 1.0, name
    first = spec_for("attn/first_mass")
    assert Point(0.0, 0.01, 0.07, 3, (0.0, 0.01, 0.02)).interval(first) == (0.0, pytest.approx(0.08))
    # differential attention's signed weights: a value below 0 lifts the bound (never an interval above its mean)
    assert Point(0.0, -0.01, 0.07, 3, (-0.03, -0.01, 0.01)).interval(first) == (
        pytest.approx(-0.08),
        pytest.approx(0.06),
    )
    steps = [0, 1, 2]
    runs = [make_run({}, seed=s, rows=_rows(steps, [0.001 + 0.02 * s] * 3, "attn/first_mass")) for s in range(2)]
    (curve,) = curves(runs, Sweep(runs), "attn/first_mass", [])
    assert (curve.low == 0.0).all() and (curve.high > 0.02).all()  # 12.7 * 0.01 below a mean of 0.011: clipped


# ---------------------------------------------------------------------------------------------------- labels
def test_a_preset_variant_is_labelled_by_the_name_it_was_asked_by() -> None:
    """variant=rope writes variant.name: scaled_dot and model.pos_encoding: rope: the label is "rope" (from the
    summary's overrides), not "scaled_dot · pos=rope"; variant=custom variant.name=mine keeps the score's name."""
    runs = []
    for variant, name, pos in (("rope", "scaled_dot", "rope"), ("scaled_dot", "scaled_dot", "sinusoidal"),
                               ("alibi", "alibi", "none"), ("custom", "mine", "sinusoidal")):  # fmt: skip
        run = make_run({"variant.name": name, "model.pos_encoding": pos})
        run.summary["overrides"] = [f"variant={variant}", "d_k=8"] + (["variant.name=mine"] if name == "mine" else [])
        runs.append(run)
    sweep = Sweep(runs)
    assert dim_keys(sweep) == ["variant.name"]
    assert sweep.dims[0].values == ("alibi", "mine", "rope", "scaled_dot")
    assert sweep.derived["model.pos_encoding"] == "variant.name"  # (and attention.score: scaled_dot for rope)
    assert [sweep.label(r, sweep.dims) for r in runs] == ["rope", "scaled_dot", "alibi", "mine"]
    assert runs[0].variant_choice == "rope" and runs[3].variant_choice is None
    assert runs[0].variant == "scaled_dot"  # the score (summary, CSV) is unchanged


def test_null_d_k_and_kv_heads_read_as_the_values_the_runs_used() -> None:
    """One sweep set d_k=8 and left num_kv_heads null (multi-head: 4), another left d_k null (64 // 4 = 16) and set
    num_kv_heads=1: the labels say d_k=16 and kv_heads=4, never null."""
    runs = []
    for seed in range(2):
        run = make_run({"d_k": 8, "num_kv_heads": None}, seed=seed)
        run.summary.update(d_k=8, num_heads=4, settings={"num_kv_heads": None, "d_k": 8})
        runs.append(run)
        run = make_run({"d_k": None, "num_kv_heads": 1}, seed=seed)
        run.summary.update(d_k=16, num_heads=4, settings={"num_kv_heads": 1, "d_k": None})
        runs.append(run)
    sweep = Sweep(runs)
    assert dim_keys(sweep) == ["d_k", "num_kv_heads"]
    assert [d.values for d in sweep.dims] == [(8, 16), (1, 4)]
    assert {sweep.label(r, sweep.dims) for r in runs} == {"d_k=8 · kv_heads=4", "d_k=16 · kv_heads=1"}
    assert sweep.main_dim().key == "d_k" and runs[1].raw_value("d_k") is None and runs[1].value("d_k") == 16


def test_run_knobs_stay_out_of_labels_unless_they_tell_configurations_apart() -> None:
    """A smoke sweep (max_steps 5, eval_every 5, 32 test examples) beside a full one: the knobs are dimensions (the
    budgets never pool) but no label names them, and the main key is not one of them; once the same configuration
    runs at both budgets, max_steps (only it) tells them apart."""
    smoke = {"max_steps": 5, "eval_every": 5, "task.datamodule.num_test": 32, "smoke": True}
    full = {"max_steps": 300, "eval_every": 100, "task.datamodule.num_test": 270, "smoke": False}
    runs = [make_run({"variant.name": v, "d_k": d_k, **smoke}, seed=s) for v in ("dot", "additive") for d_k in (8, 64)
            for s in range(2)]  # fmt: skip
    runs += [
        make_run({"variant.name": v, "lr": lr, **full}, seed=s)
        for v in ("dot", "scaled_dot")
        for lr in (1e-3, 3e-3)
        for s in (0, 1)
    ]  # fmt: skip  (d_k left null: 64 // 4 = 16)
    sweep = Sweep(runs)
    knobs = ["max_steps", "eval_every", "task.datamodule.num_test"]  # (smoke is never a dimension)
    assert sorted(d.key for d in sweep.knobs) == sorted(knobs)
    assert {"variant.name", "d_k", "lr"} <= set(dim_keys(sweep))
    labels = {sweep.label(r, sweep.dims) for r in runs}
    assert all(k.split(".")[-1] not in text for text in labels for k in knobs), labels
    assert sweep.main_dim().key == "d_k"
    table = headline(runs, sweep, "test/acc", sweep.main_dim())
    assert not any("max_steps" in label for label, _ in table.rows)
    # the same variant at both budgets: only max_steps (the first knob that splits them) joins its label
    runs += [make_run({"variant.name": "dot", "d_k": 8, **full}, seed=s) for s in (0, 1)]
    sweep = Sweep(runs)
    dot = {sweep.label(r, sweep.dims) for r in runs if r.value("variant.name") == "dot" and r.value("d_k") == 8}
    assert dot == {"dot · d_k=8 · lr=0.003 · max_steps=5", "dot · d_k=8 · lr=0.003 · max_steps=300"}
    # (every label then names it, so that they read alike; the other knobs stay out)
    assert sweep.label(runs[-3], sweep.dims) == "scaled_dot · d_k=16 · lr=0.003 · max_steps=300"
    # a chart's panels are context: within a panel per max_steps the knob is no longer needed
    assert [d.key for d in sweep.label_dims(sweep.series_dims(sweep.dim("max_steps")), [sweep.dim("max_steps")])] == [
        "variant.name",
        "d_k",
        "lr",
    ]


def test_one_formatter_prints_an_interval_the_same_way_everywhere() -> None:
    """Issue 40: an interval wider than the metric's range is "± > 100", never that and the number; a headline cell,
    the verdict sentence and a terminal report all print it through ``interval_text``."""
    acc = spec_for("test/acc")
    half = 12.706204736 * 0.2 / 2  # two seeds 20 points apart: 127 points
    assert interval_text(0.5, half, "test/acc", 2) == "50.0 % ± > 100 (n=2)"
    assert interval_text(0.5, half, acc) == "50.0 % ± > 100"
    assert interval_text(0.875, 0.0123, acc, 3) == "87.5 % ± 1.2 (n=3)"
    assert interval_text(0.875, None, acc, 1) == "87.5 % (n=1)"
    assert interval_text(1.0, 1234.5, "test/loss", 2) == "1 ± 1234 (n=2)"
    assert Cell(0.5, half, 2).text(acc) == interval_text(0.5, half, acc, 2)
    assert f"{acc.format(0.5)}{Cell(0.5, half, 2).half_text(acc)}" == interval_text(0.5, half, acc)  # page cells
