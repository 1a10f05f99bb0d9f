"""The capability card (attnlab.card): its cells from tuned sweeps, the winner per task by a paired t-test with
Holm's correction (checked by hand), its CSV and page, and its command line's refusals; tuned.json read as untrusted
input, CSV cells that never start a formula, the exit code of a failed sweep, and a signal that stops the card."""

from __future__ import annotations

import csv
import json
import math
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnlab import card
from attnlab.runs import SCHEMA_VERSION

T975 = {1: 12.706204736, 2: 4.302652730, 3: 3.182446305}


def _write_run(folder: Path, seed: int, acc: float | None, status: str = "ok") -> None:
    folder.mkdir(parents=True)
    summary = {
        "status": status,
        "seed": seed,
        "chance_accuracy": 0.125,
        "metrics": {} if acc is None else {"test/acc": acc, "val/acc_best": acc},
        "schema_version": SCHEMA_VERSION,
    }
    (folder / "summary.json").write_text(json.dumps(summary))


def _write_task(out: Path, task: str, accs: dict[str, dict[int, float]]) -> None:
    """A finished tuned sweep of ``task``: each variant's seed runs with the given test accuracies."""
    configurations = []
    for v, (variant, by_seed) in enumerate(accs.items()):
        seeds = []
        for seed, acc in by_seed.items():
            job = f"seeds/{v}{seed}_variant={variant},seed={seed}"
            _write_run(out / task / job, seed, acc)
            seeds.append({"seed": seed, "job": job, "status": "ok"})
        configurations.append(
            {"overrides": [f"variant={variant}"], "label": f"variant={variant}", "tune": [], "best": {"lr": 0.01},
             "seeds": seeds}
        )  # fmt: skip
    plan = {"format": 1, "metric": "val/acc_best", "stage": "done", "configurations": configurations}
    (out / task / "tuned.json").write_text(json.dumps(plan))


def _paired_p(a: list[float], b: list[float]) -> float:
    """Two-sided p of the paired t-test, by hand (scipy's t distribution for the tail)."""
    from scipy import stats

    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    t = mean / (sd / math.sqrt(n))
    return 2 * stats.t.sf(abs(t), n - 1)


def test_cells_and_the_winner_by_hand(tmp_path: Path) -> None:
    rng = random.Random()
    seeds = [1, 2, 3, 4]
    strong = {s: 0.9 + rng.uniform(0, 0.02) for s in seeds}
    close = {s: strong[s] - 0.001 + rng.uniform(-0.02, 0.02) for s in seeds}  # not beaten: a tie
    weak = {s: 0.3 + rng.uniform(0, 0.05) for s in seeds}
    _write_task(tmp_path, "selective_copy", {"softmax": strong, "linear": close, "gla": weak})
    _write_task(tmp_path, "compression", {"softmax": strong, "linear": weak})
    cells = card.collect(tmp_path, ["selective_copy", "compression", "memorization"])  # (no memorization sweep)
    assert [(c.task, c.variant) for c in cells] == [
        ("selective_copy", "softmax"),
        ("selective_copy", "linear"),
        ("selective_copy", "gla"),
        ("compression", "softmax"),
        ("compression", "linear"),
    ]
    by = {(c.task, c.variant): c for c in cells}
    s = by["selective_copy", "softmax"]
    xs = list(strong.values())
    mean = sum(xs) / 4
    half = T975[3] * math.sqrt(sum((x - mean) ** 2 for x in xs) / 3) / 2
    assert s.mean == pytest.approx(mean) and s.half_width == pytest.approx(half) and s.chance == 0.125

    # Holm over the two rivals of the best mean, by hand
    best = max(["softmax", "linear"], key=lambda v: by["selective_copy", v].mean)
    other = "linear" if best == "softmax" else "softmax"
    vals = {"softmax": strong, "linear": close, "gla": weak}
    p = {r: _paired_p([vals[best][k] for k in seeds], [vals[r][k] for k in seeds]) for r in (other, "gla")}
    order = sorted(p, key=p.get)
    adjusted, running = {}, 0.0
    for i, r in enumerate(order):
        running = max(running, min(1.0, (2 - i) * p[r]))
        adjusted[r] = running
    for r in (other, "gla"):
        assert by["selective_copy", r].adjusted_p == pytest.approx(adjusted[r])
    beats = {r: adjusted[r] < 0.05 for r in (other, "gla")}
    assert by["selective_copy", best].verdict == ("win" if all(beats.values()) else "tie")
    assert by["selective_copy", "gla"].verdict == ("" if beats["gla"] else "tie")
    assert by["compression", "softmax"].verdict == "win" and by["compression", "linear"].verdict == ""

    csv_path, html_path = card.write_card(tmp_path, cells, seconds=120)
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 5 and rows[0]["task"] == "selective_copy" and rows[0]["n"] == "4"
    assert float(rows[0]["test_acc"]) == pytest.approx(mean, rel=1e-5)
    page = html_path.read_text()
    assert "Content-Security-Policy" in page and "<script" not in page and "Holm" in page
    assert page.count("<tr>") == 1 + 3 + 1  # header, three variants, chance


def test_a_failed_or_missing_seed_run_leaves_the_cell_with_fewer_seeds(tmp_path: Path) -> None:
    _write_task(tmp_path, "memorization", {"softmax": {1: 0.9, 2: 0.8}, "linear": {1: 0.5}})
    _write_run(tmp_path / "memorization/seeds/x", 3, None, status="failed")
    plan = json.loads((tmp_path / "memorization/tuned.json").read_text())
    plan["configurations"][1]["seeds"].append({"seed": 3, "job": "seeds/x"})
    plan["configurations"][1]["seeds"].append({"seed": 4, "job": "seeds/never-ran"})
    _write_run(tmp_path / "outside", 5, 0.99)  # a finished run outside the sweep folder: never read
    plan["configurations"][1]["seeds"].append({"seed": 5, "job": "../outside"})
    (tmp_path / "memorization/tuned.json").write_text(json.dumps(plan))
    cells = card.collect(tmp_path, ["memorization"])
    assert [len(c.values) for c in cells] == [2, 1]
    assert cells[1].half_width is None
    assert cells[0].verdict == "tie"  # one seed against two: no test, so no win


def test_a_variant_name_is_escaped_on_the_page(tmp_path: Path) -> None:
    _write_task(tmp_path, "compression", {"<script>x</script>": {1: 0.5, 2: 0.6}})
    page = card.card_html(card.collect(tmp_path, ["compression"]))
    assert "<script>x" not in page and "&lt;script&gt;x" in page


def test_the_command_line_refuses_unknown_names_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert card.main(["--variants", "scaled_dot,nonsense", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nonsense" in err[0]
    assert card.main(["--tasks", "selective_copy", "--seeds", "a", "--out", str(tmp_path / "c")]) == 2
    assert not (tmp_path / "c").exists()


def test_the_card_command_is_a_tuned_sweep_per_task(tmp_path: Path) -> None:
    command = card.card_command("compression", ["scaled_dot", "linear"], tmp_path, seeds=[1, 2], grid=[3e-3, 1e-2])
    assert "hydra/sweeper=tuned" in command and "experiment=card" in command and "task=compression" in command
    assert "variant=scaled_dot,linear" in command and "hydra.sweeper.grid={lr:[0.003,0.01]}" in command
    assert f"hydra.sweep.dir={tmp_path / 'compression'}" == command[-1]
    assert set(card.CARD_TASKS) <= set(__import__("attnlab.tasks", fromlist=["list_tasks"]).list_tasks())


def test_the_default_card_lists_one_form_per_family_from_the_registry_rwkv7_among_them() -> None:
    """The newest registered form of each family: RWKV-7 (``rwkv7``, tagged decay and delta, registered after kda
    and deltaproduct, in attnlab/forms/rwkv7.py) stands for the delta rules; each is a variant the card's command
    line takes; a form's settings (gla's gates, the delta rules' beta_range) are its variant.params, set by the
    card's overrides."""
    from attnlab.forms import form_class, form_settings, list_forms
    from attnlab.training.config import CONF_DIR, group_choices

    variants = card.default_variants()
    assert variants == ("scaled_dot", "linear", "gla", "rwkv7")
    assert {"decay", "delta"} <= form_class("rwkv7").tags and {"decay", "delta"} <= form_class("kda").tags
    assert list_forms().index("kda") < list_forms().index("deltaproduct") < list_forms().index("rwkv7")
    assert set(variants) <= set(group_choices(CONF_DIR, "variant"))
    settings = {s.label: s for s in form_settings("recurrent")}
    assert settings["gla_channel"].params == {"gate": "channel"} and settings["kda_beta2"].params == {"beta_range": 2}
    command = card.card_command(
        "compression", ["kda", "gated_deltanet"], Path("c"), extra=["variant.params.beta_range=2"]
    )
    assert "variant=kda,gated_deltanet" in command and "variant.params.beta_range=2" in command


def test_report_warns_once_per_bad_field_and_still_builds_the_card(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _write_task(tmp_path, "compression", {"softmax": {1: 0.9, 2: 0.8}, "linear": {1: 0.5, 2: 0.4}})
    plan = json.loads((tmp_path / "compression/tuned.json").read_text())
    plan["configurations"][0]["seeds"].append({"seed": "x", "job": "seeds/00_variant=softmax,seed=1"})
    plan["configurations"][0]["seeds"].append({"seed": 9, "job": "/etc"})
    plan["configurations"].append({"label": 5, "seeds": []})
    plan["configurations"].append("not an object")
    (tmp_path / "compression/tuned.json").write_text(json.dumps(plan))
    (tmp_path / "memorization").mkdir()  # nested 200,000 deep: one warning, not a RecursionError
    (tmp_path / "memorization/tuned.json").write_text("[" * 200_000 + "]" * 200_000)
    code = card.main(["--report", "--tasks", "compression,memorization", "--out", str(tmp_path)])
    assert code == 0
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 5 and all(w.startswith("warning: ") for w in warnings), warnings
    assert "seeds[2].seed is 'x'" in warnings[0] and "'/etc' is not a folder inside" in warnings[1]
    assert "configurations[2].label is 5" in warnings[2] and "configurations[3] is 'not an object'" in warnings[3]
    assert "nested too deeply" in warnings[4]
    rows = list(csv.DictReader((tmp_path / "card.csv").open()))
    assert [(r["variant"], r["n"]) for r in rows] == [("softmax", "2"), ("linear", "2")]


def test_card_csv_text_cells_never_start_a_formula(tmp_path: Path) -> None:
    _write_task(tmp_path, "compression", {'=HYPERLINK("x")': {1: 0.5}, "-2+3": {1: 0.4}, "@SUM(A1)": {1: 0.3}})
    plan = json.loads((tmp_path / "compression/tuned.json").read_text())
    plan["configurations"][0]["best"] = {"lr": "+cmd"}
    plan["configurations"][1]["best"] = {"lr": -0.5}  # a number: stays a number
    (tmp_path / "compression/tuned.json").write_text(json.dumps(plan))
    csv_path, _ = card.write_card(tmp_path, card.collect(tmp_path, ["compression"]))
    rows = list(csv.reader(csv_path.open()))[1:]
    assert [r[1] for r in rows] == ['\'=HYPERLINK("x")', "'-2+3", "'@SUM(A1)"]
    assert [r[2] for r in rows] == ["'+cmd", "-0.5", "0.01"]
    assert float(rows[0][4]) == 0.5


def test_the_card_refuses_an_output_it_would_write_through(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "card.csv").mkdir()
    assert card.main(["--report", "--tasks", "compression", "--out", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "card.csv" in line


def _card_cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "attnlab.card", "--tasks", "compression", "--variants", "scaled_dot", "--seeds", "1",
            "--jobs", "1", "--out", str(out), *extra, "debug=fast", "diagnostics.enabled=false", "logger=none",
            "d_model=16", "num_heads=2"]  # fmt: skip


@pytest.mark.slow
def test_a_card_whose_sweep_had_no_point_that_ran_exits_1(tmp_path: Path) -> None:
    from helpers import REPO, train_env

    out = tmp_path / "card"
    proc = subprocess.run(
        _card_cmd(out, "--lr", "1e30", "max_steps=2", "eval_every=1"),  # lr=1e30 diverges at the first step
        cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "every grid point failed" in proc.stderr and "card: compression" in proc.stderr
    assert (out / "card.html").exists()


def _processes_naming(text: str) -> list[int]:
    """The pids of the processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_cards_sweep_and_prints_the_card_so_far(tmp_path: Path, signum: int, code: int) -> None:
    from helpers import REPO, train_env

    out = tmp_path / "card"
    proc = subprocess.Popen(
        _card_cmd(out, "--lr", "0.01", "max_steps=100000", "eval_every=1"),
        cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        summary = None
        while time.monotonic() < deadline and proc.poll() is None:  # until the tuning job is training
            summary = next(iter(out.glob("compression/tune/*/summary.json")), None)
            if summary is not None and '"running"' in summary.read_text() and (summary.parent / "checkpoints").exists():
                break
            time.sleep(0.5)
        assert summary is not None and proc.poll() is None, proc.communicate(timeout=60)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, stdout[-2000:] + stderr[-3000:]
    assert f"card: stopped by {signal.Signals(signum).name}" in stderr
    assert "card: " in stdout and (out / "card.html").exists() and (out / "card.csv").exists()
    ended = json.loads(summary.read_text())
    assert ended["status"] == "interrupted", (ended, stderr[-3000:])  # the job heard it, and can be resumed
    assert _processes_naming(str(out)) == []  # the sweep and its job are gone


def test_the_cards_dry_run_plans_every_tasks_sweep_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """``python -m attnlab.card --dry-run``: each task's tuned sweep as ``train.py --dry-run`` plans it, then the
    card's total; no card folder (issue 40)."""
    import re

    from attnlab import card

    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    argv = ["--dry-run", "--tasks", "associative_recall,compression", "--variants", "scaled_dot,gla", "--seeds", "1,2"]
    assert card.main([*argv, "--lr", "1e-2", "--out", str(tmp_path / "card"), "max_steps=20", "eval_every=10"]) == 0
    out = capsys.readouterr().out
    assert out.count("a tuned sweep of 6 job(s)") == 2  # 2 variants × (1 grid point + 2 seeds), per task
    assert "card: task 1/2: associative_recall" in out and "card: task 2/2: compression" in out
    assert re.search(r"card: 12 jobs in 2 tasks, estimated \d+:\d\d \([\d.]+ min, 2 job\(s\) at a time\)", out)
    assert not (tmp_path / "card").exists()
