"""The options every generated task shares, in real runs: ``resample`` (a fresh training set per epoch that a resumed
run replays exactly), ``test_lengths`` (``test/acc@L`` in summary.json and metrics.jsonl, checked against an
evaluation of the best checkpoint written here), and the milestones ``train/plateau_steps`` and
``train/steps_to_99`` (checked against the validation rows of metrics.jsonl). Every run folder goes to tmp_path.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import read_summary
from hydra import compose
from test_resume import _CrashAt, assert_same_run

import attnlab.callbacks
from attnlab import training as T
from attnlab.module import EncoderModule
from attnlab.runs import METRICS_FILE, read_metrics
from attnlab.tasks import IGNORE_INDEX, AssociativeRecall, ListOps

pytestmark = pytest.mark.usefixtures("restore_process_state")

# two fused pairs over 4 keys and 4 values: one layer learns it in a few dozen steps, so both milestones are reached
EASY = (
    "task=associative_recall",
    "task.datamodule.fused_pairs=true",
    "task.datamodule.num_pairs=2",
    "task.datamodule.vocab_keys=4",
    "task.datamodule.vocab_values=4",
    "task.datamodule.num_train=512",
    "task.datamodule.num_val=64",
    "task.datamodule.num_test=64",
    "d_model=32",
    "num_layers=1",
    "batch_size=32",
    "lr=1e-2",
    "max_steps=40",
    "eval_every=5",
    "logger=none",
    "diagnostics.enabled=false",
    "results_table=false",
    "threads=1",
)


# ------------------------------------------------------------------------------------ resample


def test_resample_draws_a_new_training_set_per_epoch_and_the_same_one_again() -> None:
    task = AssociativeRecall(num_pairs=4, num_train=64, batch_size=8, resample=True, seed=3)
    fixed = AssociativeRecall(num_pairs=4, num_train=64, batch_size=8, seed=3)
    val, test = task.tensors("val")[0].clone(), task.tensors("test")[0].clone()
    task.set_epoch(0)
    epoch0 = task.tensors("train")[0].clone()
    task.set_epoch(1)
    epoch1 = task.tensors("train")[0].clone()
    task.set_epoch(0)
    assert torch.equal(task.tensors("train")[0], epoch0)  # epoch 0 again: the same data
    assert not torch.equal(epoch0, epoch1)
    assert torch.equal(task.tensors("val")[0], val) and torch.equal(task.tensors("test")[0], test)  # never redrawn
    assert torch.equal(fixed.tensors("val")[0], val)  # resample leaves the evaluation sets as they were
    other = AssociativeRecall(num_pairs=4, num_train=64, batch_size=8, resample=True, seed=3)
    other.set_epoch(1)
    assert torch.equal(other.tensors("train")[0], epoch1)  # from seed and epoch alone
    fixed.set_epoch(1)  # a no-op without resample
    unchanged = AssociativeRecall(num_pairs=4, num_train=64, seed=3).tensors("train")[0]
    assert torch.equal(fixed.tensors("train")[0], unchanged)


def refusal(cfg_overrides: list[str], folder: Path, capsys: pytest.CaptureFixture) -> str:
    """The one-line error of a run refused before it starts (and that it wrote nothing)."""
    assert math.isnan(T.run(compose("config", overrides=cfg_overrides), folder))
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert not folder.exists()
    return err


def test_resample_is_refused_by_a_fixed_data_set(hydra_ctx: None, tmp_path: Path, capsys) -> None:
    err = refusal(["task=digits", "+task.datamodule.resample=true"], tmp_path / "r", capsys)
    assert "resample=true needs a generated task; digits is a fixed data set" in err


def test_a_resampled_run_crashed_mid_epoch_resumes_to_the_uninterrupted_result(
    hydra_ctx: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 sequences in batches of 16: 4 steps per epoch; checkpoints every 6 steps fall mid-epoch (6, 18) and at an
    epoch's end (12). A crash at 15 resumes from 12 in epoch 3's data, a crash at 20 from 18, mid-epoch 4."""
    small = [
        "task=associative_recall",
        "task.datamodule.num_pairs=4",
        "task.datamodule.resample=true",
        "task.datamodule.num_train=64",
        "task.datamodule.num_val=32",
        "task.datamodule.num_test=32",
        "batch_size=16",
        "d_model=32",
        "max_steps=24",
        "eval_every=6",
        "logger=none",
        "results_table=false",
        "diagnostics.every_n_steps=5",
        "threads=1",
    ]
    T.run(compose("config", overrides=small), tmp_path / "reference")
    out = tmp_path / "run"
    monkeypatch.setattr(attnlab.callbacks, "DivergenceGuard", _CrashAt)
    monkeypatch.setattr(_CrashAt, "steps", [15, 20])
    assert math.isnan(T.run(compose("config", overrides=small), out))
    assert math.isnan(T.run(compose("config", overrides=[*small, "resume=true"]), out))
    assert read_summary(out)["resumed_at_step"] == 12
    T.run(compose("config", overrides=[*small, "resume=true"]), out)
    assert read_summary(out)["resumed_at_step"] == 18
    assert_same_run(tmp_path / "reference", out)


# ------------------------------------------------------------------------------------ test lengths and milestones


@pytest.fixture(scope="module")
def easy_run(hydra_ctx: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("easy") / "run"
    T.run(compose("config", overrides=[*EASY, "task.datamodule.test_lengths=[4,9]"]), out)
    assert read_summary(out)["status"] == "ok", read_summary(out).get("reason")
    return out


def test_every_test_length_is_reported_and_is_the_accuracy_of_the_best_checkpoint(easy_run: Path) -> None:
    metrics = read_summary(easy_run)["metrics"]
    for length in (4, 9):
        assert {f"test/acc@{length}", f"test/loss@{length}"} <= metrics.keys()
    rows = read_metrics(easy_run / METRICS_FILE)
    test_row = next(r for r in rows if "test/acc@9" in r)
    assert test_row["test/acc@4"] == metrics["test/acc@4"] and test_row["test/acc"] == metrics["test/acc"]

    # the same numbers, evaluated here from the best checkpoint on test sets drawn here
    module = EncoderModule.load_from_checkpoint(easy_run / "checkpoints" / "best.ckpt", map_location="cpu")
    module.eval()
    task = AssociativeRecall(
        num_pairs=2, vocab_keys=4, vocab_values=4, fused_pairs=True, num_train=512, num_val=64, num_test=64
    )
    for length in (4, 9):
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([0, 2, length])))
        tokens, labels = (torch.from_numpy(a) for a in task.generate_length(64, rng, length))
        assert tokens.shape == (64, length)
        with torch.no_grad():
            predicted = module(tokens).argmax(-1)
        keep = labels != IGNORE_INDEX
        acc = (predicted[keep] == labels[keep]).double().mean().item()
        assert metrics[f"test/acc@{length}"] == pytest.approx(acc, abs=1e-6)


def test_milestones_are_the_first_validations_past_chance_and_past_99(easy_run: Path) -> None:
    summary = read_summary(easy_run)
    rows = [r for r in read_metrics(easy_run / METRICS_FILE) if "val/acc" in r]
    chance = 1 / 2  # two pairs: a guess between the context's two values
    plateau = next(r["step"] for r in rows if r["val/acc"] >= chance + 0.1 * (1 - chance))
    to_99 = next(r["step"] for r in rows if r["val/acc"] >= 0.99)
    assert summary["metrics"]["train/plateau_steps"] == plateau
    assert summary["metrics"]["train/steps_to_99"] == to_99
    assert 0 < plateau <= to_99 <= 40 and to_99 % 5 == 0


def test_a_milestone_never_reached_is_absent(hydra_ctx: None, tmp_path: Path) -> None:
    T.run(compose("config", overrides=[*EASY, "max_steps=5", "lr=1e-4"]), tmp_path / "run")
    metrics = read_summary(tmp_path / "run")["metrics"]
    assert metrics["val/acc"] < 0.99 and "train/steps_to_99" not in metrics


def test_test_lengths_errors_are_one_line(hydra_ctx: None, tmp_path: Path, capsys) -> None:
    cases = [
        ("task.datamodule.test_lengths=[64,20]", "test_lengths must be >= 2*num_pairs + num_queries = 48, got 20"),
        ("task.datamodule.test_lengths=[64,64]", "test_lengths has a length twice"),
    ]
    for override, message in cases:
        err = refusal(["task=associative_recall", "task.datamodule.num_pairs=16", override], tmp_path / "r", capsys)
        assert message in err
    with pytest.raises(ValueError, match="task listops does not support test_lengths"):
        ListOps(test_lengths=[32])


def test_experiment_mqar_is_zoology_s_setup_and_runs(hydra_ctx: None, tmp_path: Path) -> None:
    cfg = compose("config", overrides=["experiment=mqar", "debug=fast", "threads=1", "results_table=false"])
    assert cfg.mask.name == "causal" and cfg.task.name == "associative_recall"
    data = cfg.task.datamodule
    assert data.resample is True and data.fused_pairs is False
    assert data.seq_len > 2 * data.num_pairs + data.num_pairs  # filler among the queries
    T.run(cfg, tmp_path / "run")
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "ok" and summary["mask"] == "causal"
