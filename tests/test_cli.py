"""The command line as users type it: one-line errors for bad input, a diverging job that fails cleanly while the
sweep goes on, and the README's Python examples."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("ATTNLAB_UID", None)
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def _train(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )


BAD_INPUTS = [
    (["variant=adittive"], r"unknown variant 'adittive'; did you mean 'additive'\?.*scaled_dot"),
    (["mask=causl"], r"unknown mask 'causl'; did you mean 'causal'\?"),
    (["task=listop"], r"unknown task 'listop'; did you mean 'listops'\?"),
    (["d_k=0"], r"d_k must be an integer >= 1, got 0"),
    (["num_heads=-2"], r"num_heads must be an integer >= 1, got -2"),
    (["d_model=0"], r"d_model must be an integer >= 1, got 0"),
    (["d_model=30", "num_heads=4"], r"d_model \(30\) is not divisible by num_heads \(4\)"),
    (["lr=-0.1"], r"lr must be a finite number >= 0, got -0.1"),
    (["mask=sliding_window", "mask.window=0"], r"window must be an integer >= 1, got 0"),
    (["variant=relative_position", "variant.params.clip=-1"], r"clip must be an integer >= 0"),
    (["batch_size=5000"], r"batch_size \(5000\) is larger than the training set \(1257\)"),
    (["variant=custom", "variant.name=cosyne"], r"unknown variant 'cosyne'"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "message"), BAD_INPUTS, ids=lambda v: "_".join(v) if isinstance(v, list) else "")
def test_bad_input_prints_one_line_and_exits_2(tmp_path, overrides, message):
    proc = _train(*overrides, "logger=none", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    summary = tmp_path / "run" / "summary.json"
    if summary.exists():  # errors found after composing are recorded in the run folder too
        data = json.loads(summary.read_text())
        assert data["status"] == "failed" and re.search(message, data["reason"])


@pytest.mark.slow
def test_full_error_shows_the_traceback(tmp_path):
    env = {**_env(), "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(
        [sys.executable, "train.py", "d_k=0", "logger=none", f"hydra.run.dir={tmp_path}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr


@pytest.mark.slow
def test_diverging_job_fails_cleanly_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _train(
        "-m", "variant=scaled_dot", "lr=1e12,1e-3", "debug=fast", "results_table=false", f"hydra.sweep.dir={sweep}"
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # every job ran, and the exit code says one failed
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 2
    first, second = (json.loads((j / "summary.json").read_text()) for j in jobs)
    assert first["lr"] == 1e12 and first["status"] == "failed"
    assert re.match(r"training diverged at step \d+: (loss|gradient) is (nan|inf)", first["reason"])
    assert second["status"] == "ok"
    assert "1 ok, 1 failed" in proc.stdout
    assert "training diverged" in proc.stderr
    # the failed job's W&B run was finished and marked failed (exit code 1), the good one with 0
    wandb_cli = Path(sys.executable).parent / "wandb"
    for job, code in zip(jobs, (1, 0), strict=True):
        (run_dir,) = (job / "wandb").glob("offline-run-*")
        records = subprocess.run(
            [str(wandb_cli), "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True, check=True
        ).stdout
        exits = [json.loads(line)["exit"] for line in records.splitlines() if '"type":"exit"' in line]
        assert exits and exits[-1].get("exit_code", 0) == code


def test_readme_python_examples_run(tmp_path):
    """Every ```python block of the README runs as written (in a fresh interpreter, in order)."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 2
    script = tmp_path / "readme_examples.py"
    script.write_text("\n\n".join(blocks))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
