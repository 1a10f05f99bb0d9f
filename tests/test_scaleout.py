"""Scaling out: the SLURM / submitit launcher configs, the Optuna search (a diverging trial does not stop it), a
sweep through submitit's local executor, and data-parallel training on two CPU processes (one writer, metrics
reduced over both).

Tests of the optional plugins skip when the plugin is not installed (``pip install -e .[dev]`` installs them).
Every run folder goes to tmp_path.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from helpers import read_summary, run_cli, run_folders, run_train
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf

from attnlab import training as T
from attnlab.runs import METRICS_FILE, SUMMARY_FILE, read_metrics
from attnlab.training.cli import check_plugins
from attnlab.training.lifecycle import _failed_value


def need(extra: str) -> None:
    """Skip unless the optional plugin of ``extra`` (and the library under it) imports."""
    modules = {
        "optuna": ("hydra_plugins.hydra_optuna_sweeper._impl", "optuna"),
        "slurm": ("hydra_plugins.hydra_submitit_launcher.submitit_launcher", "submitit"),
    }[extra]
    for module in modules:
        pytest.importorskip(module, reason=f"{module} is not installed (pip install -e .[{extra}])")


# ------------------------------------------------------------------------------------ configs (fast)


def test_slurm_and_local_launchers_extend_the_plugin_configs(hydra_ctx: None) -> None:
    need("slurm")
    cfg = compose(
        "config",
        overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=120"],
        return_hydra_config=True,
    )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.timeout_min) == ("gpu", 1, 120)
    assert launcher.tasks_per_node == launcher.nodes == 1
    assert OmegaConf.to_container(launcher)["submitit_folder"] == "${hydra.sweep.dir}/.submitit/%j"
    assert "qos" in launcher and "account" in launcher  # the plugin's own keys are all there

    local = compose("config", overrides=["hydra/launcher=local"], return_hydra_config=True).hydra.launcher
    assert local._target_.endswith("submitit_launcher.LocalLauncher")
    assert local.gpus_per_node == 0


def test_optuna_search_space_and_direction(hydra_ctx: None) -> None:
    need("optuna")
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
    from optuna.distributions import CategoricalDistribution, LogUniformDistribution

    cfg = compose("config", overrides=["hparams_search=optuna"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper")
    assert sweeper.direction == "maximize" and sweeper.storage is None
    assert cfg.optimized_metric == "val/acc_best"
    space, fixed = create_params_from_overrides([f"{k}={v}" for k, v in sweeper.params.items()])
    assert not fixed
    assert space["lr"] == LogUniformDistribution(1e-4, 1e-2)
    assert space["d_k"] == CategoricalDistribution((8, 16, 32))
    assert space["num_heads"] == CategoricalDistribution((1, 2, 4))
    # the search composes into a runnable job config (no leftover sweep syntax)
    job = compose("config", overrides=["hparams_search=optuna", "d_k=16", "num_heads=2", "lr=0.001"])
    assert (job.d_k, job.num_heads, job.lr) == (16, 2, 0.001)

    # a failed trial returns the worst value for the direction (Optuna 2.x stops the whole search on NaN)
    HydraConfig.instance().set_config(cfg)
    try:
        assert _failed_value() == -math.inf
    finally:
        HydraConfig.instance().cfg = None
    assert math.isnan(_failed_value())  # no sweeper direction: NaN


def test_a_missing_plugin_costs_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if "optuna" in name else real(name, *a))
    with pytest.raises(T.ConfigError, match=r"hparams_search=optuna needs the optuna extra: pip install -e"):
        check_plugins(["-m", "hparams_search=optuna", "debug=fast"])
    check_plugins(["hydra/launcher=local", "variant=dot"])  # installed here: no error


def test_the_slurm_launcher_without_a_cluster_costs_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """No srun on PATH (as on this machine): one line that names the local launcher, before Hydra starts."""
    need("slurm")
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(T.ConfigError, match=r"hydra/launcher=slurm needs a SLURM cluster.*use hydra/launcher=local"):
        check_plugins(["-m", "hydra/launcher=slurm", "variant=dot"])
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}")
    check_plugins(["-m", "hydra/launcher=slurm", "variant=dot"])  # with a cluster: no error


# ------------------------------------------------------------------------------------ real sweeps (slow)


@pytest.mark.slow
def test_optuna_search_goes_on_past_a_diverging_trial(tmp_path: Path) -> None:
    """Three trials over lr in {1e12, 3e-3} (and the config's d_k, num_heads): the seeded sampler tries both, the
    1e12 trials diverge and count as -inf, and the search writes its best parameters."""
    need("optuna")
    sweep = tmp_path / "sweep"
    proc = run_train(
        "-m",
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=3",
        "lr=choice(1e12,3e-3)",
        "debug=fast",
        "logger=none",
        "results_table=false",
        "diagnostics.heatmaps=false",  # (no attention maps: none is looked at here)
        f"hydra.sweep.dir={sweep}",
        returncode=1,  # the search went on, and the exit code says that trials failed
    )
    jobs = run_folders(sweep)
    assert len(jobs) == 3, [j.name for j in jobs]
    summaries = [read_summary(j) for j in jobs]
    ok = [s for s in summaries if s["status"] == "ok"]
    failed = [s for s in summaries if s["status"] == "failed"]
    assert ok and failed, [(s["lr"], s["status"]) for s in summaries]
    assert all(s["lr"] == 1e12 and s["reason"].startswith("training diverged") for s in failed)
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(results["best_params"]) == {"lr", "d_k", "num_heads"}
    assert results["best_params"]["lr"] == 3e-3
    assert results["best_value"] == max(s["metrics"]["val/acc_best"] for s in ok)
    assert f"{len(ok)} ok, {len(failed)} failed" in proc.stdout


@pytest.mark.slow
def test_submitit_local_launcher_runs_a_sweep(tmp_path: Path) -> None:
    """Two jobs through submitit (the SLURM launcher's code path, run locally): each in its own process, both ok,
    in the sweep folder named after the launch id they inherit."""
    need("slurm")
    proc = run_train(
        "-m",
        "hydra/launcher=local",
        "variant=dot,scaled_dot",
        "debug=fast",
        "logger=none",
        "results_table=false",
        "diagnostics.heatmaps=false",
        f"hydra.sweep.dir='{tmp_path}/sweep_${{attnlab_uid:}}'",
        returncode=0,
    )
    (sweep,) = [p for p in tmp_path.iterdir() if p.name.startswith("sweep_")]
    jobs = run_folders(sweep)
    assert len(jobs) == 2, [j.name for j in jobs]
    summaries = [read_summary(j) for j in jobs]
    assert [s["status"] for s in summaries] == ["ok", "ok"], summaries
    assert {s["variant"] for s in summaries} == {"dot", "scaled_dot"}
    assert {s["launch_id"] for s in summaries} == {sweep.name.removeprefix("sweep_")}
    logs = sorted((sweep / ".submitit").glob("*/*_log.out"))
    assert len(logs) == 2, logs  # one submitit job each
    assert "2 ok, 0 failed" in proc.stdout


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_has_one_writer_and_reduced_metrics(tmp_path: Path) -> None:
    """``trainer=ddp`` with two CPU processes (gloo): one summary, one metrics.jsonl without duplicated rows, one W&B
    run, and test/acc equal to an independent one-process evaluation of the best checkpoint on the whole test set
    (33 sequences: not a multiple of 2, so a sample counted twice or missed would show). The values computed at an
    epoch's end (val/acc_best, the milestones) are logged with sync_dist, so Lightning does not warn."""
    run = tmp_path / "run"
    proc = run_train(
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "debug=fast",
        "max_steps=20",
        "eval_every=10",
        "task.datamodule.num_val=33",
        "task.datamodule.num_test=33",
        "trainer.limit_val_batches=1.0",
        "trainer.limit_test_batches=1.0",
        "logger=wandb",
        "results_table=false",
        "diagnostics.heatmaps=false",
        f"hydra.run.dir={run}",
        returncode=0,
    )
    assert "sync_dist" not in proc.stdout + proc.stderr
    summary = read_summary(run)
    assert summary["status"] == "ok", summary.get("reason")
    assert summary["world_size"] == 2 and summary["steps"] == 20
    assert "val/acc_best" in summary["metrics"]
    rows = read_metrics(run / METRICS_FILE)
    pairs = [(r["step"], k) for r in rows for k in r if k not in ("step", "epoch")]
    assert len(pairs) == len(set(pairs)), "metrics.jsonl has rows from more than one process"
    # each process trains on its half of the 64 training sequences: 2 batches of 16 per epoch, not 4
    assert max(r["epoch"] for r in rows if "train/loss" in r) == 9
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1
    assert len(list(tmp_path.rglob(SUMMARY_FILE))) == 1

    # the reference: the best checkpoint on the whole test set in this process
    cfg = OmegaConf.load(run / "config.yaml")
    datamodule = instantiate(cfg.task.datamodule)
    datamodule.setup("test")
    module = T.build_module(cfg, datamodule)
    assert summary["best_checkpoint"] == "checkpoints/best.ckpt"  # relative to the run folder
    ckpt = torch.load(run / summary["best_checkpoint"], map_location="cpu", weights_only=True)
    module.load_state_dict(ckpt["state_dict"])
    module.eval()
    tokens, labels = datamodule.tensors("test")
    assert len(labels) == 33
    with torch.no_grad():
        accuracy = (module(tokens).argmax(-1) == labels).float().mean().item()
    assert summary["metrics"]["test/acc"] == pytest.approx(accuracy, abs=1e-6)


@pytest.mark.slow
def test_ddp_in_a_sweep_fails_with_one_line(tmp_path: Path) -> None:
    """The job refuses before any process starts: the command line runs in this one (:func:`run_cli`: the same
    ``main``, Hydra's multirun with its basic launcher, exit code and output)."""
    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "debug=fast",
        "logger=none",
        f"hydra.sweep.dir={sweep}",
        returncode=1,
    )
    (job,) = run_folders(sweep)
    summary = read_summary(job)
    assert summary["status"] == "failed"
    assert "cannot run in a -m sweep" in summary["reason"] and "hydra/launcher=slurm" in summary["reason"]
    assert "0 ok, 1 failed" in proc.stdout
