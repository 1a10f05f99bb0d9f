"""Attention diagnostics during training: the callback's schedule and log names, the fast path between probes,
and W&B offline runs read back from disk (no mocks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import read_summary, run_train
from hydra import compose, initialize_config_dir

import attnlab.attention
from attnlab.callbacks import AttentionDiagnostics
from attnlab.module import EncoderModule
from attnlab.runs import read_metrics
from attnlab.tasks import Digits
from attnlab.training import CONF_DIR, run
from attnlab.training.loggers import JsonlLogger

METRICS = (
    "entropy",
    "entropy_norm",
    "max_prob",
    "saturation",
    "attn_distance",
    "row_mass",
    "support",
    "first_mass",
    "logit_std",
    "logit_max",
)


def _digits_module(num_train: int, **sizes) -> tuple[Digits, EncoderModule]:
    """A small Digits datamodule (set up) and a d_model=12 EncoderModule for it, seeded."""
    torch.manual_seed(0)
    dm = Digits(batch_size=16, num_train=num_train, num_val=16, num_test=16)
    dm.setup("fit")
    return dm, EncoderModule(dm.vocab_size, dm.num_classes, dm.per_token, dm.pad_id, dm.max_len, d_model=12, **sizes)


def _tiny_fit(tmp_path: Path, every: int, max_steps: int, num_layers: int = 2, num_heads: int = 3):
    dm, module = _digits_module(64, num_heads=num_heads, num_layers=num_layers, max_steps=max_steps)
    diag = AttentionDiagnostics(every_n_steps=every, probe_size=4, output_dir=tmp_path)
    logger = JsonlLogger(tmp_path)
    trainer = L.Trainer(
        max_steps=max_steps,
        logger=logger,
        callbacks=[diag],
        enable_progress_bar=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        enable_model_summary=False,
        accelerator="cpu",
        log_every_n_steps=1,
    )
    trainer.fit(module, datamodule=dm)
    logger.finalize("success")
    return diag, read_metrics(tmp_path / "metrics.jsonl")


def test_diagnostics_log_at_step_zero_every_n_steps_and_at_the_end(tmp_path):
    diag, rows = _tiny_fit(tmp_path, every=2, max_steps=5)
    steps = [r["step"] for r in rows if "attn/entropy" in r]
    assert steps == [0, 2, 4, 5]
    row = next(r for r in rows if "attn/entropy" in r)
    for metric in METRICS:
        assert f"attn/{metric}" in row
        for layer in range(2):
            assert f"attn/L{layer}/{metric}" in row
            for head in range(3):
                assert f"attn/L{layer}H{head}/{metric}" in row
    # the model mean is the mean over every layer and head
    heads = [row[f"attn/L{layer}H{head}/entropy"] for layer in range(2) for head in range(3)]
    assert row["attn/entropy"] == pytest.approx(sum(heads) / len(heads))
    assert (tmp_path / "maps.png").stat().st_size > 1000  # output_dir is the run's attention/ folder
    assert diag.initial["attn/entropy_norm"] > 0.5  # near-uniform at initialisation
    # digits has no vocabulary: dilution and rank collapse, but no head-type scores (and a note saying why)
    heads = {"near_mass", "locality", "rank_residual", "rank_residual_attn"}
    assert set(diag.model_means(diag.final)) == {f"attn/{m}" for m in (*METRICS, *heads, "act_max", "signed")}
    assert diag.final["attn/signed"] == 0.0 and row["attn/L1/signed"] == 0.0  # softmax: no layer is signed
    assert {"attn/L1/rank_residual", "attn/L0/rank_residual_attn", "attn/L1H2/locality"} <= set(row)
    assert diag.notes and "pixel" in diag.notes[0]


def test_training_forward_takes_the_fast_path_between_probes(tmp_path, monkeypatch):
    """The eager path (which computes weights) runs only when the callback probes: 2 layers × (step 0, 3, 6; the
    heatmaps at the end reuse the last probe's weights)."""
    calls = []
    original = attnlab.attention.MultiHeadAttention.attend

    def counting_attend(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(attnlab.attention.MultiHeadAttention, "attend", counting_attend)
    _tiny_fit(tmp_path, every=3, max_steps=6)
    assert len(calls) == 2 * 3


def _probe_module(num_layers: int = 3) -> tuple[EncoderModule, AttentionDiagnostics]:
    dm, module = _digits_module(32, num_heads=3, num_layers=num_layers)
    diag = AttentionDiagnostics(probe_size=4)
    diag._probe = dm.probe_batch(4)[0]
    return module, diag


def test_layers_without_differential_attention_never_report_negative_mass(monkeypatch):
    """signed=False, not a guess from the values: no negative_mass column even when a layer's weights go negative."""
    module, diag = _probe_module()
    stats, _ = diag.compute(module)
    assert "attn/row_mass" in stats and "attn/L2H0/support" in stats
    assert not any(k.endswith("/negative_mass") for k in stats)

    original = attnlab.attention.MultiHeadAttention.attend
    shifted = module.encoder.layers[2].self_attn

    def shifted_attend(self, *args, **kwargs):
        o = original(self, *args, **kwargs)
        return o._replace(weights=o.weights - 0.5) if self is shifted else o

    monkeypatch.setattr(attnlab.attention.MultiHeadAttention, "attend", shifted_attend)
    stats, _ = diag.compute(module)
    assert stats["attn/L2/row_mass"] < 0.5  # layer 2's weights really are signed
    assert not any(k.endswith("/negative_mass") for k in stats)


def test_differential_layers_report_negative_mass():
    """A layer whose attention is differential is measured with signed=True: negative_mass for that layer only."""
    module, diag = _probe_module()
    torch.manual_seed(1)
    module.encoder.layers[1].self_attn = attnlab.attention.MultiHeadAttention(12, 3, 4, differential=True, layer=2)
    for _ in range(2):  # the same columns every time
        stats, _ = diag.compute(module)
        signed_keys = {k for k in stats if k.endswith("/negative_mass")}
        assert signed_keys == {"attn/negative_mass", "attn/L1/negative_mass"} | {
            f"attn/L1H{h}/negative_mass" for h in range(3)
        }
        assert stats["attn/L1/negative_mass"] >= 0.0
        assert stats["attn/negative_mass"] == stats["attn/L1/negative_mass"]  # averaged over the layers that have it
        for metric in METRICS:  # logits with two maps per head are accepted
            assert f"attn/L1/{metric}" in stats


def _read_wandb(run_dir: Path) -> tuple[dict, list[dict]]:
    """Records of the single offline W&B run under ``run_dir/wandb``, read by wandb's own reader."""
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    wandb_cli = Path(sys.executable).parent / "wandb"
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(runs[0])], capture_output=True, text=True, check=True
    ).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    run_record = next(r["run"] for r in records if r["type"] == "run")
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    exits = [r["exit"] for r in records if r["type"] == "exit"]
    assert exits and exits[-1].get("exit_code", 0) == 0
    return run_record, history


@pytest.mark.slow
def test_multirun_jobs_get_distinct_offline_wandb_runs_with_diagnostics(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "variant=dot,scaled_dot", "debug=fast", "results_table=false", f"hydra.sweep.dir={sweep}"]
    args.append("diagnostics.importance=true")  # (auto: off in a sweep)
    run_train(*args, wandb=None, timeout=600, returncode=0)  # W&B as the config says: offline
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 2
    run_ids, groups = set(), set()
    for job in jobs:
        summary = read_summary(job)
        assert summary["status"] == "ok"
        assert 0.0 <= summary["metrics"]["attn/saturation"] <= 1.0
        assert "attn/entropy_norm" in summary["attn_init"]
        run_record, history = _read_wandb(job)
        run_ids.add(run_record["run_id"])
        groups.add(run_record.get("run_group"))
        assert run_record["job_type"] == summary["variant"]
        assert run_record["config"]["update"]["variant"]["name"] == summary["variant"]  # full resolved config
        logged = {k for item in history for k in item}
        assert {"attn/entropy", "attn/saturation", "attn/L0H0/entropy_norm", "train/loss", "val/acc"} <= logged
        # what the heads do: dilution and rank collapse at every probe, importance and the pruning curves at the end
        assert {"attn/L1H0/locality", "attn/L0/rank_residual", "attn/L1H3/importance", "prune/auc_random"} <= logged
        step0 = [item for item in history if item.get("trainer/global_step") == 0 and "attn/entropy" in item]
        assert step0, "diagnostics at initialisation (step 0) are in the W&B history"
    assert len(run_ids) == 2  # one W&B run per job, never shared
    assert len(groups) == 1 and None not in groups  # grouped by sweep


@pytest.mark.parametrize("logger", ["csv", "none"])
def test_csv_and_none_loggers_still_write_local_metrics_and_summary(tmp_path, logger):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["debug=fast", f"logger={logger}", "results_table=false"])
    run(cfg, tmp_path)
    summary = read_summary(tmp_path)
    assert summary["status"] == "ok"
    for key in ("attn/entropy", "attn/entropy_norm", "attn/max_prob", "attn/saturation"):
        assert key in summary["metrics"]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert any("attn/L1H3/saturation" in r for r in rows)
    assert (tmp_path / "csv" / "metrics.csv").exists() == (logger == "csv")
    assert (
        "no head-type scores for task digits: its tokens are pixel intensities" in (tmp_path / "train.log").read_text()
    )
    assert not (tmp_path / "wandb").exists()


def test_act_max_is_the_largest_residual_activation_of_each_layer_and_of_the_model():
    """attn/L{l}/act_max = max |h| of layer l's output over the probe (the residual stream, recomputed here layer by
    layer); the model's entry is the largest over the layers, not their mean; padded positions never count."""
    from attnlab.callbacks import _largest_activation

    module, diag = _probe_module()
    with torch.no_grad():  # a large activation from layer 1 on (the stream keeps it), so the mean is not the max
        module.encoder.layers[1].ff[2].bias.fill_(7.0)
    stats, _ = diag.compute(module)
    encoder, tokens = module.encoder, diag._probe
    module.eval()
    with torch.no_grad():
        h = encoder.embed(tokens)
        if encoder.pos is not None:
            h = h + encoder.pos(tokens.shape[1])
        expected = []
        for layer, mask in zip(encoder.layers, encoder.build_masks(tokens), strict=True):
            h, _ = layer(h, mask)
            expected.append(max(abs(float(v)) for v in h.flatten()))
    for n, value in enumerate(expected):
        assert stats[f"attn/L{n}/act_max"] == pytest.approx(value, rel=1e-6)
    assert stats["attn/act_max"] == pytest.approx(max(expected)) and stats["attn/act_max"] > sum(expected) / 3

    h = torch.zeros(2, 3, 4)
    h[0, 2, 1] = -9.0  # a padded position: left out
    h[1, 0, 3] = 2.5
    keep = torch.tensor([[True, True, False], [True, True, True]])
    assert float(_largest_activation(h, keep)) == 2.5
    assert float(_largest_activation(h, None)) == 9.0
