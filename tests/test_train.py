"""Tests of the training layer: every variant learns a fixed batch, one in-process ``run``, and (marked slow) real
``python train.py`` subprocesses: a multirun sweep, two sweeps started together, the joblib launcher, ``imports``.

Every run folder goes to tmp_path (``hydra.run.dir`` / ``hydra.sweep.dir`` / ``run(cfg, tmp_path)``).
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import helpers
import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, SUBPROCESS_TIMEOUT, compose_cfg, read_summary, run_folders, train_cmd, train_env
from hydra.utils import instantiate
from omegaconf import OmegaConf

import attnlab
from attnlab import training as T
from attnlab.module import IGNORE_INDEX, EncoderModule
from attnlab.runs import METRICS_FILE, read_metrics

VARIANTS = helpers.SCORES  # every registered built-in score is a variant (conf/variant/<name>.yaml)


# ------------------------------------------------------------------------------------ fixtures and helpers


pytestmark = pytest.mark.usefixtures("restore_process_state")


# this file's runs: W&B disabled, and a run that fails shows its traceback; run_train asserts a clean exit
subprocess_env = functools.partial(train_env, wandb="disabled", full_error=True)
run_train = functools.partial(helpers.run_train, wandb="disabled", full_error=True, returncode=0)


def assert_ok(summary: dict) -> None:
    assert summary["status"] == "ok", summary
    for key in ("val/acc_best", "test/acc"):
        value = summary["metrics"][key]
        assert 0.0 <= value <= 1.0, (key, value)


# where a run would land if a test's run-folder override were lost (Hydra's default folders, Lightning, W&B)
DEFAULT_RUN_PLACES = ("outputs", "multirun", "lightning_logs", "wandb", "checkpoints")


def files_in_default_run_places() -> set[Path]:
    return {p for name in DEFAULT_RUN_PLACES if (REPO / name).exists() for p in (REPO / name).rglob("*")}


@pytest.fixture
def repo_stays_clean() -> Iterator[None]:
    """A test that runs train.py must leave nothing in the repository (all run folders go to tmp_path)."""
    before = files_in_default_run_places()
    yield
    new = sorted(files_in_default_run_places() - before)
    assert not new, f"a test left files in the repository: {[str(p.relative_to(REPO)) for p in new[:10]]}"


# ------------------------------------------------------------------------------------ every variant learns


def loss_of(module: EncoderModule, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = module(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_fits_a_fixed_batch(hydra_ctx: None, variant: str) -> None:
    """A composed debug=fast config, the module built by ``build_module``, 20 AdamW steps on one batch: the loss
    must fall clearly (a score whose gradient does not reach the model, or that breaks training, fails here)."""
    cfg = compose_cfg("debug=fast", f"variant={variant}", "d_model=32", "num_heads=4", "num_layers=2")
    torch.manual_seed(0)
    dm = instantiate(cfg.task.datamodule)
    module = T.build_module(cfg, dm)
    assert [layer["score"] for layer in module.hparams.attention] == [variant, variant]  # per layer, as configured
    assert module.hparams.d_k == T.resolve_d_k(cfg) == 8
    tokens, labels = next(iter(dm.train_dataloader()))
    tokens, labels = tokens[:8], labels[:8]  # 8 digits of 64 pixels: enough to see learning, cheap for additive
    module.train()
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = loss_of(module, tokens, labels)
        assert torch.isfinite(loss), f"{variant}: non-finite loss {loss}"
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    final = loss_of(module, tokens, labels).item()
    assert final < 0.7 * losses[0], f"{variant}: loss {losses[0]:.3f} -> {final:.3f} ({losses})"
    # and every parameter of the attention score and its position bias (the presets' tables) took part (has a
    # gradient) where they have parameters
    for name, p in module.named_parameters():
        if ".score." in name or ".position_bias." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{variant}: no gradient reaches {name}"


def test_training_step_returns_the_cross_entropy(hydra_ctx: None) -> None:
    cfg = compose_cfg("debug=fast", "task=associative_recall")  # a per-token task with ignored positions
    torch.manual_seed(0)
    dm = instantiate(cfg.task.datamodule)
    module = T.build_module(cfg, dm)
    assert module.per_token
    tokens, labels = next(iter(dm.train_dataloader()))
    assert (labels == IGNORE_INDEX).any()
    loss, _, _ = module._loss((tokens, labels))
    torch.testing.assert_close(loss, loss_of(module, tokens, labels))


def test_configure_optimizers_covers_every_parameter_once(hydra_ctx: None) -> None:
    cfg = compose_cfg("debug=fast", "variant=relative_position", "max_steps=100", "lr=1e-3")
    dm = instantiate(cfg.task.datamodule)
    module = T.build_module(cfg, dm)
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert conf["lr_scheduler"]["interval"] == "step"
    seen = [id(p) for group in opt.param_groups for p in group["params"]]
    assert len(seen) == len(set(seen)) == len(list(module.parameters()))
    decays = {group["weight_decay"] for group in opt.param_groups}
    assert decays == {cfg.model.weight_decay, 0.0}
    # linear warm-up from lr / warmup_steps, then the peak, then decay to min_ratio * lr at max_steps
    warmup = module.hparams.warmup_steps
    assert warmup == min(cfg.model.warmup_steps, max(1, cfg.max_steps // 5))
    assert math.isclose(opt.param_groups[0]["lr"], cfg.lr / warmup)
    lrs = []
    for _ in range(cfg.max_steps):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert math.isclose(max(lrs), cfg.lr)
    assert math.isclose(lrs[-1], 0.1 * cfg.lr, rel_tol=1e-6)


# ------------------------------------------------------------------------------------ one in-process run


def test_run_in_process_writes_the_run_files(hydra_ctx: None, tmp_path: Path, repo_stays_clean: None) -> None:
    cfg = compose_cfg("debug=fast", "logger=none", "threads=1", "results_table=false")
    out = tmp_path / "run"
    value = T.run(cfg, out)

    summary = read_summary(out)
    assert_ok(summary)
    assert summary["variant"] == cfg.variant.name == "scaled_dot"
    assert summary["mask"] == cfg.mask.name
    assert summary["task"] == cfg.task.name
    assert summary["d_k"] == cfg.d_model // cfg.num_heads == 16  # d_k: null resolved
    assert summary["num_heads"] == cfg.num_heads
    assert summary["d_model"] == cfg.d_model == 64  # debug=fast keeps the configured model
    assert summary["seed"] == cfg.seed
    assert isinstance(summary["params"], int) and summary["params"] > 0
    assert isinstance(summary["wall_time_s"], float) and summary["wall_time_s"] > 0
    assert summary["steps"] == cfg.max_steps
    assert value == pytest.approx(summary["metrics"][cfg.optimized_metric])

    text = (out / "config.yaml").read_text()
    assert "${" not in text, "config.yaml is not resolved"
    saved = OmegaConf.load(out / "config.yaml")
    assert saved.variant.name == "scaled_dot"
    assert saved.task.datamodule.batch_size == cfg.batch_size  # was ${batch_size}
    assert saved.trainer.max_steps == cfg.max_steps  # was ${max_steps}

    rows = read_metrics(out / METRICS_FILE)
    assert rows and all("step" in row for row in rows)
    assert any("train/loss" in row for row in rows)
    assert any("val/acc" in row for row in rows)
    assert max(row["step"] for row in rows) <= cfg.max_steps


# ------------------------------------------------------------------------------------ real subprocesses (slow)


# a multirun over variant x d_k x lr x seed: tests/test_dashboard.py::real_sweep (32 jobs, read back by the page)


@pytest.mark.slow
def test_two_sweeps_started_together_get_different_folders(tmp_path: Path, repo_stays_clean: None) -> None:
    """Both sweeps use the default-style folder pattern ``<time to the second>_<launch id>``: even when they resolve
    it in the same second, the launch id keeps them apart."""
    root = tmp_path / "multirun"
    # quoted for Hydra's override parser (there is no shell): the interpolations reach Hydra unresolved
    sweep_dir = f"hydra.sweep.dir='{root}/${{now:%H-%M-%S}}_${{attnlab_uid:}}'"
    args = ["-m", "variant=dot", "debug=fast", "logger=none", "threads=1", sweep_dir]
    procs = [
        subprocess.Popen(
            train_cmd(*args), cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        results = [proc.communicate(timeout=SUBPROCESS_TIMEOUT) for proc in procs]
    finally:  # on a timeout, do not leave the other run behind
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, f"{out[-3000:]}\n{err[-5000:]}"

    sweeps = sorted(p for p in root.iterdir() if p.is_dir())
    assert len(sweeps) == 2, [p.name for p in sweeps]
    launch_ids = []
    for sweep in sweeps:
        folders = run_folders(sweep)
        assert len(folders) == 1, [f.name for f in folders]
        summary = read_summary(folders[0])
        assert_ok(summary)
        assert summary["variant"] == "dot"
        # the folder is named after the launch id that the job saw
        assert summary["launch_id"] and sweep.name.endswith("_" + summary["launch_id"]), (sweep.name, summary)
        launch_ids.append(summary["launch_id"])
    assert launch_ids[0] != launch_ids[1]


@pytest.mark.slow
def test_a_user_score_and_mask_are_selected_by_name_through_imports(tmp_path: Path, repo_stays_clean: None) -> None:
    """The README's route for code of your own: register in your module, name the module in ``imports``, select
    with ``variant=custom variant.name=...`` and ``mask=custom mask.name=...`` (parameters with ``+...``)."""
    tag = uuid.uuid4().hex[:8]
    module_name = f"attnlab_test_plugins_{tag}"
    score_name, mask_name = f"test_cosine_{tag}", f"test_dilated_{tag}"
    (tmp_path / f"{module_name}.py").write_text(
        "import torch.nn.functional as F\n"
        "import attnlab\n\n\n"
        f'@attnlab.register_score("{score_name}")\n'
        "def cosine(q, k, scale: float = 5.0):\n"
        "    return scale * F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)\n\n\n"
        f'@attnlab.register_mask("{mask_name}")\n'
        "def dilated(q_idx, kv_idx, every: int = 2):\n"
        "    return (q_idx - kv_idx) % every == 0\n"
    )
    assert score_name not in attnlab.list_scores() and mask_name not in attnlab.list_masks()
    env = subprocess_env(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "run"
    run_train(
        "variant=custom",
        f"variant.name={score_name}",
        "+variant.params.scale=3.0",
        "mask=custom",
        f"mask.name={mask_name}",
        "+mask.every=3",
        f"imports=[{module_name}]",
        "debug=fast",
        "logger=none",
        "threads=1",
        f"hydra.run.dir='{out}'",
        env=env,
    )
    summary = read_summary(out)
    assert_ok(summary)
    assert (summary["variant"], summary["variant_params"]) == (score_name, {"scale": 3.0})
    assert summary["mask"] == mask_name
    saved = OmegaConf.load(out / "config.yaml")
    assert saved.imports == [module_name] and saved.mask == {"name": mask_name, "every": 3}
