"""A run folder of attnlab 0.2 (before AttentionConfig, the attention node and per-layer attention) or 0.3 (before
short convolutions and backend parameters) still resumes, its checkpoints load, and it shows on the dashboard beside
new runs without a dimension of its own.

The 0.2 folder is made from a run of today by undoing, file by file, what 0.3 changed in what a run writes:
config.yaml without the ``attention`` node, ``model.pattern`` / ``local_window`` / ``layer_kinds`` / ``layers`` and
``model.rope.spectrum``; checkpoints with the preset's bias at ``…score.position_bias.rel_k`` and 0.2's
hyperparameters (``score``, ``score_params``, ``mask``, ``attention`` as a dict of the other stages); summary.json
without the fields added since. (A run made by commit 928ac7c itself was resumed the same way by hand.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose

from attnlab import training as T
from attnlab.dashboard import load_runs
from attnlab.dashboard.dims import Sweep
from attnlab.runs import SCHEMA_VERSION

pytestmark = pytest.mark.usefixtures("restore_process_state")

SMALL = (
    "debug=fast",
    "d_model=32",
    "logger=none",
    "results_table=false",
    "variant=relative_position",
    "variant.params.clip=3",
    "normalizer=softmax1",
    "task.datamodule.num_train=128",
    "task.datamodule.num_val=64",
    "max_steps=12",
    "eval_every=6",
)
NEW_SUMMARY_FIELDS = ("backend", "attention", "pattern", "layers", "backends", "state_size")


def _as_0_2(folder: Path) -> None:
    """Rewrite a run folder of today as attnlab 0.2 wrote it."""
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config.pop("attention")
    for key in ("pattern", "local_window", "layer_kinds", "layers", "short_conv"):
        config["model"].pop(key)
    config["model"]["rope"].pop("spectrum")
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    summary = json.loads((folder / "summary.json").read_text())
    for key in NEW_SUMMARY_FIELDS:
        summary.pop(key, None)
    (folder / "summary.json").write_text(json.dumps(summary))
    for ckpt in (folder / "checkpoints").glob("*.ckpt"):
        state = torch.load(ckpt, weights_only=False)
        state["state_dict"] = {
            k.replace("self_attn.position_bias.", "self_attn.score.position_bias."): v
            for k, v in state["state_dict"].items()
        }
        hp = state["hyper_parameters"]
        layer = hp.pop("attention")[0]
        hp.pop("pattern", None)
        hp.update(score="relative_position", score_params={"clip": 3}, mask=None, d_v=None)
        hp["attention"] = {k: layer[k] for k in ("num_kv_heads", "rope", "qk_norm", "softcap", "normalizer")}
        hp["attention"] |= {"normalizer_params": {}, "position_bias": "none", "position_bias_params": {}}
        hp["attention"]["differential"] = False
        torch.save(state, ckpt)


def test_a_run_folder_of_0_2_extends_refuses_a_change_and_shows_beside_new_runs(
    hydra_ctx: None, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """One run of today, copied and rewritten as 0.2 wrote it: a resume with another normalizer is refused in one
    line that names only that change; an extension continues from its checkpoint; both folders show on one page
    with nothing varying between them."""
    new, old = tmp_path / "runs" / "new", tmp_path / "runs" / "old"
    T.run(compose("config", overrides=list(SMALL)), new)
    shutil.copytree(new, old)
    before = {k: v.clone() for k, v in torch.load(old / "checkpoints" / "last.ckpt")["state_dict"].items()}
    _as_0_2(old)

    capsys.readouterr()
    T.run(compose("config", overrides=[*SMALL, "resume=true", "max_steps=18", "normalizer=softmax"]), old)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "with other settings than it was started with: normalizer.name: 'softmax1'" in err[0]
    assert "attention" not in err[0] and "model." not in err[0]
    assert json.loads((old / "summary.json").read_text())["steps"] == 12

    T.run(compose("config", overrides=[*SMALL, "resume=true", "max_steps=18"]), old)
    summary = json.loads((old / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 18
    assert [s["kind"] for s in summary["segments"]] == ["new", "extend"]
    assert summary["attention"] == "relative_position · score(clip=3) · normalizer=softmax1"
    # the extension started from the saved weights: the bias table moved back under position_bias, trained on
    extended = torch.load(old / "checkpoints" / "last.ckpt")["state_dict"]
    table = "encoder.layers.0.self_attn.form.position_bias.rel_k"
    assert table in extended and not torch.equal(extended[table], before[table])
    runs = load_runs(tmp_path / "runs")
    assert len(runs) == 2 and Sweep(runs).dims == []  # same settings: nothing varies between 0.2 and today


def _as_0_3(folder: Path) -> None:
    """Rewrite a run folder of today as attnlab 0.3 wrote it: no short convolution, backend parameters, layer kind
    S or state size."""
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["model"].pop("short_conv")
    config["model"]["layer_kinds"].pop("S")
    for key in ("max_tokens", "match"):  # (0.5)
        config.pop(key)
    for key in ("short_conv", "backend_params"):
        config["attention"].pop(key)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    summary = json.loads((folder / "summary.json").read_text())
    summary.pop("state_size")
    summary["schema_version"] = 3
    (folder / "summary.json").write_text(json.dumps(summary))


def test_a_run_folder_of_0_3_extends_and_shows_beside_new_runs(hydra_ctx: None, tmp_path: Path) -> None:
    """A run of 0.3 (before short convolutions, backend parameters and state sizes) extends with nothing reported
    as changed, and shows beside a new run with nothing varying between them."""
    new, old = tmp_path / "runs" / "new", tmp_path / "runs" / "old"
    T.run(compose("config", overrides=list(SMALL)), new)
    shutil.copytree(new, old)
    _as_0_3(old)
    T.run(compose("config", overrides=[*SMALL, "resume=true", "max_steps=18"]), old)
    summary = json.loads((old / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 18 and summary["schema_version"] == SCHEMA_VERSION
    assert len(summary["state_size"]) == 2
    runs = load_runs(tmp_path / "runs")
    assert len(runs) == 2 and Sweep(runs).dims == []
