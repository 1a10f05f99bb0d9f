"""Issue 60, the rest of the adversarial pass: a dry run plans sweeps written with Hydra's ``range()`` and
``choice()`` (read by Hydra's own parser and expanded as its sweeper expands them); a plan of 10⁶ jobs is a count
made from representatives, in seconds; a dry run on a folder that holds a finished run says the command would be
refused there, in the command's own words; a decode cache of another form, dtype or device is refused in one line;
the dashboard warns on a negative or non-finite ``flops_per_token`` or ``params``; a key that is not ASCII is refused
naming its character. Real parts throughout: Hydra in-process (:func:`helpers.run_cli`), real run folders, real
encoders."""

from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path

import pytest
import torch
from helpers import run_cli, run_train

from attnlab.config import AttentionConfig
from attnlab.decode import encoder_step, init_cache
from attnlab.encoder import Encoder
from attnlab.runs import RunFolder, Summary
from attnlab.training.config import ConfigError

TINY = ("d_model=16", "num_heads=2", "num_layers=1", "debug=fast", "logger=none", "diagnostics.heatmaps=false")
LRS = "lr=choice(1e-3,2e-3,3e-3,4e-3,5e-3,6e-3,7e-3,8e-3,9e-3,1e-2)"  # ten values

pytestmark = pytest.mark.usefixtures("restore_process_state")


def _rows(stdout: str) -> list[list[str]]:
    """The plan table's body rows as cells (a cell folded over several lines joined)."""
    rows: list[list[str]] = []
    for line in stdout.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            if rows and not cells[0]:
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
            else:
                rows.append(cells)
    return rows


def _dry(tmp_path: Path, *args: str, returncode: int | None = None):
    return run_cli(*args, "--dry-run", cwd=tmp_path, returncode=returncode, ATTNLAB_CACHE_DIR=str(tmp_path / "c"))


def _hydra_jobs(arguments: list[str]) -> list[list[str]]:
    """The basic sweeper's own jobs (Hydra's parser and split_arguments), in its order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(arguments)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


# ------------------------------------------------------------------------------- 1. range() and choice()


def test_a_dry_run_plans_a_sweep_written_with_range_and_choice(tmp_path):
    proc = _dry(tmp_path, "-m", *TINY, "seed=range(3,5)", "lr=choice(0.001)", returncode=0)
    assert "requires --multirun" not in proc.stdout + proc.stderr
    assert "a sweep of 2 job(s)" in proc.stdout
    assert [r[1] for r in _rows(proc.stdout)] == ["seed=3", "seed=4"]  # (lr: one value, the same in every job)
    assert all(r[-1] != "-" for r in _rows(proc.stdout))  # each planned and estimated
    assert not (tmp_path / "multirun").exists()


def test_the_plans_jobs_are_hydras_own_expansion():
    from attnlab.training.plan import _first_values, _space

    args = ["d_k=range(8,33,8)", "lr=choice(0.001,0.01)", "variant=dot,scaled_dot", "+tag=x", "seed=range(0,3)",
            "x=[1,2]", "model.weight_decay=range(0,0.3,0.1)", "d_k=4,8"]  # fmt: skip
    space = _space(args)
    assert [space.job(n) for n in range(space.count)] == _hydra_jobs(args)  # (d_k's later override in its place)
    assert _first_values(args)[:3] == ["d_k=8", "lr=0.001", "variant=dot"]
    import fnmatch

    from attnlab.training.compare import register_named_models, variant_options

    register_named_models()  # (as the command line does: the forms' named settings are variant options too)
    deltas = sorted(fnmatch.filter(variant_options(), "*delta*"))
    assert {"deltanet", "deltaproduct", "gated_deltanet", "gated_deltanet_beta2"} <= set(deltas)
    assert _space(["variant=glob(*delta*)"]).values == [deltas]
    with pytest.raises(ConfigError, match=r"^the sweep cannot be planned: BasicSweeper does not support .*INTERVAL"):
        _space(["lr=interval(0,1)"])


# ------------------------------------------------------------------------------- 2. a plan of 10⁶ jobs


def test_a_plan_of_a_million_jobs_is_counted_from_representatives_in_seconds(tmp_path):
    """seed × lr × weight decay change no job's time: the two max_steps values are the only shapes, each built (on
    several representatives, so that more of the cost-free values are checked), and the total is exact (each
    shape's time × its 500,000 jobs). (Hydra's parser takes about a second for a list of thousands of values.)"""
    seeds = "seed=" + ",".join(str(s) for s in range(250))  # (plain lists: what the old plan took too)
    lrs, decays = (
        "lr=" + ",".join(f"{k}e-5" for k in range(1, 201)),
        "model.weight_decay=" + ",".join(f"0.{k}" for k in range(10)),
    )
    started = time.perf_counter()
    proc = _dry(tmp_path, "-m", *TINY, seeds, lrs, decays, "max_steps=5,10", returncode=0)
    elapsed = time.perf_counter() - started
    # about 10 s on an idle 2-core machine, imports included (before: 10⁶ lists, then one composition and check per
    # job, about a second each: days; the old plan had not listed its first job after 120 s)
    assert elapsed < 60, elapsed
    assert "a sweep of 1,000,000 job(s) (a count: 8 representative(s) below)" in proc.stdout
    rows = _rows(proc.stdout)
    assert {r[1].split("max_steps=")[1] for r in rows} == {"5", "10"}
    assert len({r[1].split(" lr=")[0] for r in rows}) == 8  # eight seeds (and lr, weight decay values) checked
    text = " ".join(proc.stdout.split())
    assert "1,000,000 jobs is a count (seed 250 × lr 200 × model.weight_decay 10 × max_steps 2 values)" in text
    assert "each shape was built (8 job(s) in all), and the total is each shape's time × its 500,000 jobs" in text
    assert "step times: 1 model(s) timed now" in text  # (one model: max_steps changes no step's time)


def test_a_counted_sweep_draws_a_latin_hypercube_sample_in_hydras_numbering():
    from attnlab.training.plan import MAX_SAMPLE_JOBS, _space, _sweep_plan

    args = ["seed=range(10)", LRS, "model.weight_decay=range(0,1,0.1)", "max_steps=range(5,51,5)",
            "d_k=range(8,81,8)", "+tag=range(10)"]  # fmt: skip
    started = time.perf_counter()
    space = _space(args)
    plan = _sweep_plan(space)
    assert time.perf_counter() - started < 2  # counted, never listed (before: 10⁶ lists, then 10⁶ compositions)
    assert plan.total == space.count == 10**6 and plan.sampled and not plan.grouped
    assert len(plan.jobs) == 10 <= MAX_SAMPLE_JOBS
    assert sum(j.weight for j in plan.jobs) == pytest.approx(10**6)
    lists = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in _parse(args)]
    for job in plan.jobs:  # each one is the job of that number in Hydra's order (itertools.product)
        assert job.overrides == list(next(itertools.islice(itertools.product(*lists), job.number, None)))
    for i, key_values in enumerate(lists):  # every value of every swept key is in one representative
        assert {j.overrides[i] for j in plan.jobs} == set(key_values)
    assert "a Latin-hypercube sample, seed 0" in plan.notes[0] and "not a list" in plan.notes[0]
    estimates = _sweep_plan(_space(["seed=range(100)", "d_k=8,16"]))
    estimates.jobs[0].seconds, estimates.jobs[1].seconds = 10.0, 30.0  # (as the costing sets them)
    by_job = estimates.estimates()
    assert len(by_job) == 200 and by_job["0"] == 10.0 and by_job["1"] == 30.0 and by_job["198"] == 10.0


def _parse(args):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(args)


@pytest.mark.slow
def test_a_million_job_sweep_of_six_keys_answers_in_seconds_in_a_fresh_process(tmp_path):
    args = ["seed=range(10)", LRS, "model.weight_decay=range(0,1,0.1)", "max_steps=range(5,51,5)",
            "d_k=range(8,81,8)", "+tag=range(10)"]  # fmt: skip
    started = time.perf_counter()
    proc = run_train("-m", *TINY, *args, "--dry-run", cwd=tmp_path, ATTNLAB_CACHE_DIR=str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.perf_counter() - started < 90
    assert "a sweep of 1,000,000 job(s) (a count: 10 representative(s) below)" in proc.stdout


# ------------------------------------------------------------------------------- 3. a folder that holds a run


def _finished(folder: Path) -> Path:
    RunFolder(folder).path.mkdir(parents=True)
    RunFolder(folder).write_summary(Summary(status="ok", steps=5))
    return folder


def test_a_dry_run_on_a_finished_runs_folder_says_the_command_would_be_refused_in_its_words(tmp_path):
    run = _finished(tmp_path / "run")
    real = run_cli(*TINY, f"hydra.run.dir={run}", cwd=tmp_path, returncode=2, ATTNLAB_CACHE_DIR=str(tmp_path / "c"))
    (line,) = real.stderr.strip().splitlines()
    assert line.startswith("error: ") and "already holds a run (ok, step 5)" in line
    before = sorted(p.name for p in run.iterdir())
    dry = _dry(tmp_path, *TINY, f"hydra.run.dir={run}", returncode=2)
    assert dry.stderr.strip().splitlines() == [line]  # the very line the command prints
    out = " ".join(dry.stdout.split())
    assert f"job 0 would be refused: {line.removeprefix('error: ')}" in out
    assert "the command would be refused" in out
    assert sorted(p.name for p in run.iterdir()) == before


def test_a_dry_run_on_a_folder_another_process_holds_says_so_as_the_run_would(tmp_path):
    import os

    run = _finished(tmp_path / "run")
    with RunFolder(run).lock("train.py seed=1"):  # (the words of RunFolderBusy: test_cli.py checks the real run's)
        dry = _dry(tmp_path, *TINY, f"hydra.run.dir={run}", returncode=2)
    (line,) = dry.stderr.strip().splitlines()
    holder = rf"pid {os.getpid()} on .* \(train.py seed=1\)"
    assert re.fullmatch(rf"error: run folder {re.escape(str(run))} is in use by {holder}; wait for it to end, or use "
                        r"another folder", line), line  # fmt: skip
    assert f"job 0 would be refused: run folder {run} is in use by pid" in " ".join(dry.stdout.split())


def test_a_sweeps_dry_run_names_the_jobs_whose_folders_hold_a_run(tmp_path):
    sweep = tmp_path / "sweep"  # job 0's folder, as conf/hydra/default.yaml names it (the overrides but debug, logger)
    _finished(sweep / "0_d_model=16,num_heads=2,num_layers=1,seed=0")
    proc = _dry(tmp_path, "-m", *TINY[:5], "seed=0,1", f"hydra.sweep.dir={sweep}", returncode=0)
    out = " ".join(proc.stdout.split())
    assert re.search(r"job 0 would be refused: \S*/0_d_model=16,\S* already holds a run \(ok, step 5\)", out), out
    assert "job 1 would be refused" not in out and "the sweep runs the others and exits 1" in out


# ------------------------------------------------------------------------------- 4. decode caches


def _encoder(dtype=torch.float64, **options) -> Encoder:
    torch.manual_seed(0)
    config = AttentionConfig(mask="causal", **options)
    return Encoder(40, 16, 2, 2, max_len=64, pos_encoding="sinusoidal", attention=config).to(dtype).eval()


def _filled(encoder: Encoder) -> list:
    cache = init_cache(encoder)
    with torch.no_grad():
        encoder_step(encoder, torch.tensor([1, 2, 3]), cache)
    return cache


def _on_meta(cache: list) -> list:
    state = cache[0].state
    if isinstance(state, torch.Tensor):
        cache[0].state = state.to("meta")
    else:
        state.k, state.v = state.k.to("meta"), state.v.to("meta")
    return cache


FORMS = {"softmax": {}, "deltanet": {"score": "deltanet", "normalizer": "none"}}


@pytest.mark.parametrize(
    ("made", "used", "spoil", "match"),
    [
        ("softmax", "deltanet", None, r"^the cache of layer 1 was filled by another form \(softmax, 2 heads, d_k 8, "
         r"d_v 8\), but layer 1 of this encoder is deltanet, 2 heads, d_k 8, d_v 8: "),
        ("deltanet", "softmax", None, r"^the cache of layer 1 was filled by another form \(deltanet, .*\), but layer "
         r"1 of this encoder is softmax, "),
        ("softmax", "softmax", "float32", r"^the cache of layer 1 holds float32 tensors, but the encoder computes in "
         r"float64: "),
        ("deltanet", "deltanet", "float32", r"^the cache of layer 1 holds float32 tensors, but the encoder computes "
         r"in float64: "),
        ("softmax", "softmax", "meta", r"^the cache of layer 1 is on meta, but the encoder is on cpu: "),
        ("deltanet", "deltanet", "meta", r"^the cache of layer 1 is on meta, but the encoder is on cpu: "),
    ],
    ids=["softmax_to_deltanet", "deltanet_to_softmax", "float32_kv", "float32_state", "meta_kv", "meta_state"],
)  # fmt: skip
def test_a_decode_cache_of_another_form_dtype_or_device_is_refused_in_one_line(made, used, spoil, match):
    cache = _filled(_encoder(torch.float32 if spoil == "float32" else torch.float64, **FORMS[made]))
    if spoil == "meta":
        _on_meta(cache)
    with torch.no_grad(), pytest.raises(ValueError, match=match) as err:
        encoder_step(_encoder(**FORMS[used]), torch.tensor([1, 2, 3]), cache)
    assert "\n" not in str(err.value)
    assert [c.length for c in cache] == [1, 1]  # the cache is as it was


# ------------------------------------------------------------------------------- 5. the dashboard


def test_the_dashboard_warns_on_negative_or_non_finite_flops_and_params(tmp_path, capsys):
    from attnlab.dashboard.cli import main as dashboard_main
    from attnlab.dashboard.load import load_run

    root = tmp_path / "runs"
    spoilt = {"negative_flops": ('"flops_per_token": -1.5', "flops_per_token is -1.5"),
              "nan_flops": ('"flops_per_token": NaN', "flops_per_token is NaN"),
              "inf_flops": ('"flops_per_token": Infinity', "flops_per_token is Infinity"),
              "negative_params": ('"params": -3', "params is -3"),
              "nan_params": ('"params": NaN', "params is NaN")}  # fmt: skip
    for name, (field, _) in {**spoilt, "good": ('"params": 123', None)}.items():
        folder = root / name
        folder.mkdir(parents=True)
        summary = Summary(status="ok", steps=5, flops_per_token=2.0e6).to_dict()
        text = json.dumps(summary).rstrip("}") + ", " + field + "}"  # (the field's own JSON, NaN included)
        (folder / "summary.json").write_text(text)
        (folder / "metrics.jsonl").write_text('{"step": 5, "val/acc": 0.5}\n')
    for name, (_, said) in spoilt.items():
        run = load_run(root / name)
        (problem,) = run.problems  # (a NaN params is not an integer: attnlab.runs says so, in the same words)
        assert problem.startswith(f"{root / name / 'summary.json'}: {said}, which is not ") and "; ignored" in problem
        assert "a finite number >= 0" in problem or name == "nan_params"
        field = said.split()[0]
        assert run.compute(field) is None and (field != "params" or run.params is None)
    good = load_run(root / "good")
    assert good.problems == [] and good.params == 123 and good.compute("flops_per_token") == 2.0e6
    assert dashboard_main([str(root), "-o", str(tmp_path / "page.html")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == len(spoilt)
    for name, (_, said) in spoilt.items():
        assert any(w.startswith(f"attnlab-dashboard: warning: run {name}: ") and said in w for w in warnings)


# ------------------------------------------------------------------------------- 6. a key that is not ASCII


@pytest.mark.parametrize(
    ("arg", "named"),
    [
        ("dé_k=3", "'é' (U+00E9)"),
        ("task.é=1", "'é' (U+00E9)"),
        ("+ключ=1", "'к' (U+043A)"),
        ("~d\u200bk", "'\\u200b' (U+200B)"),
    ],
)
def test_a_key_that_is_not_ascii_is_refused_naming_its_character(tmp_path, arg, named):
    proc = _dry(tmp_path, arg, returncode=2)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot read the override {arg!r}: its key ") and f" has {named}, " in line
    assert "quote the value" not in line  # (quoting a value cannot help a key)


def test_a_run_folders_recorded_key_that_is_not_ascii_is_refused_naming_its_character(tmp_path):
    from attnlab.training.cli import with_run_overrides

    folder = tmp_path / "run"
    folder.mkdir()
    RunFolder(folder).write_summary(Summary(status="interrupted", steps=5, overrides=["dé_k=3"]))
    with pytest.raises(ConfigError) as err:
        with_run_overrides(["resume=true", f"hydra.run.dir={folder}"])
    assert str(err.value) == (
        f"{folder / 'summary.json'}: the recorded override 'dé_k=3' cannot be parsed: its key has 'é' (U+00E9), and "
        "a config key is ASCII only"
    )
