"""The studies' committed tables are what experiments/table.py makes from their committed summary.csv, in the
project's interval convention (mean ± 95 % t half-width, with n), checked by hand for one cell."""

from __future__ import annotations

import csv
import itertools
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
T975 = {1: 12.706204736, 2: 4.302652730}  # two-sided 95 % t quantiles


def test_a_table_cell_is_the_mean_and_the_95_percent_t_half_width() -> None:
    rows = [r for r in csv.DictReader((REPO / "experiments/dk_saturation/summary.csv").open()) if r["status"] == "ok"]
    accs = [100 * float(r["test/acc"]) for r in rows if (r["variant"], r["d_k"]) == ("dot", "512")]
    assert len(accs) == 3
    half = T975[2] * statistics.stdev(accs) / math.sqrt(3)
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import table
    finally:
        sys.path.pop(0)
    text = table.table(rows, ["variant", "d_k"], ["test/acc:pct"])
    assert f"| dot | 512 | {statistics.mean(accs):.1f} ± {half:.1f} | 3 |" in text


def _table_commands(readme: Path) -> list[list[str]]:
    """The arguments of every ``python experiments/table.py ...`` a study's README quotes, inline or in a code block
    (a command ends at the next backtick; backslash line continuations are joined)."""
    text = readme.read_text()
    found = re.findall(r"python experiments/table\.py ([^`]+)`", text)
    return [command.replace("\\\n", " ").split() for command in found]


READMES = sorted((REPO / "experiments").glob("*/README.md"))
TABLE_STUDIES = ("dk_saturation", "position", "stability", "normalizers", "heads")


def test_every_study_quotes_the_commands_of_its_tables() -> None:
    quoting = {readme.parent.name for readme in READMES if _table_commands(readme)}
    assert set(TABLE_STUDIES) <= quoting


@pytest.mark.parametrize("readme", READMES, ids=[r.parent.name for r in READMES])
def test_the_committed_results_tables_match_the_committed_csv(readme: Path, capsys: pytest.CaptureFixture) -> None:
    """Each table command a README quotes, run on the committed summary.csv, gives body lines found verbatim in that
    README (its header may name the columns in words)."""
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import table
    finally:
        sys.path.pop(0)
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        for args in _table_commands(readme):
            table.main(args)
            made = capsys.readouterr().out.splitlines()[2:]
            assert made, args
            text = readme.read_text()
            for line in made:
                assert line in text, (args, line)
    finally:
        os.chdir(cwd)
    assert not re.search(r"standard deviation", readme.read_text())


# a study's run.sh, or another script of it (heads/tuned: experiments/heads/tuned.sh)
STUDIES = (
    "position",
    "stability",
    "normalizers",
    "heads",
    "linear_mqar",
    "recall_state",
    "induction",
    "pruning",
    "state_tracking",
    "forgetting_recall",
    "gated_output",
    "lr_window",
    "hybrid_ratio",
    "hybrid_ratio/longer",
    "gated_output/longer",
    "lr_window/longer",
    "heads/tuned",
    "normalizers/tuned",
)
# studies of few configurations (pruning: its 3 variants; gated_output: 2 forms x 3 gates); a tuned script compares
# fewer too
FEW_JOBS = {"pruning": 3, "gated_output": 6}


def _sweeps(study: str, runs: Path) -> list[tuple[str, list[str]]]:
    """(name, overrides) of every sweep a study's run.sh launches, read from a dry run (PY=: runs nothing)."""
    env = {**os.environ, "PY": ":", "RUNS": str(runs)}
    out = subprocess.run(
        ["bash", f"experiments/{study}.sh" if "/" in study else f"experiments/{study}/run.sh"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = [re.match(r"== (\S+): (.*)$", line) for line in out.splitlines()]
    return [(m.group(1), m.group(2).split()) for m in found if m]


def _jobs(overrides: list[str]) -> list[list[str]]:
    """Every job of a multirun: the product of the comma-separated values (brackets are one value)."""
    choices = []
    for item in overrides:
        if item.startswith("~"):  # a deletion (~key): one value
            choices.append([item])
            continue
        key, _, value = item.partition("=")
        values = [value] if value.startswith("[") else value.split(",")
        choices.append([f"{key}={v}" for v in values])
    return [list(job) for job in itertools.product(*choices)]


@pytest.mark.slow
@pytest.mark.parametrize("study", STUDIES)
def test_every_job_of_a_study_composes_and_passes_the_config_checks(study: str, tmp_path: Path) -> None:
    """Each study's run.sh names an experiment config and sweeps that compose and pass train.py's checks for every
    combination of values (seeds aside), so that `bash experiments/<study>/run.sh` cannot fail on a bad override."""
    from hydra import compose, initialize_config_dir

    from attnlab.training.config import validate_config

    sweeps = _sweeps(study, tmp_path)
    assert sweeps, f"experiments/{study}/run.sh launches no sweep"
    assert len({name for name, _ in sweeps}) == len(sweeps)
    count = 0
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for name, overrides in sweeps:
            assert any(o.startswith("experiment=") for o in overrides), (name, overrides)
            for job in _jobs(overrides):
                validate_config(compose(config_name="config", overrides=job))
                count += 1
    assert count >= (3 if "/" in study else FEW_JOBS.get(study, 10))
