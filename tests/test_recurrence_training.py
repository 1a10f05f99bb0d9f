"""The decay and delta-rule presets train end to end: every recurrent form of the registry beside linear attention
(from its tags: retnet, gla, deltanet, gated_deltanet, kda), at its defaults and at each of its named settings
(:func:`~attnlab.forms.form_settings`: gla_channel, gla_mamba2, deltanet_beta2, ..., kda_beta2, each through its
command line ``variant=<form> variant.params.<key>=<value>``), runs ``debug=fast`` to status ok under ``mask=causal``
on ListOps (right-padded: causal AND key padding) on the chunked backend, with its state size H·d_k·d_v (plus its
short convolution's buffers) recorded; ``kda`` and the per-channel ``gla`` train so on every task of the task
registry that allows a causal model; a user's form trains through ``imports=[module]``; hybrids with one softmax layer
in four (Gated DeltaNet's, and Kimi Linear's ``variant=kda num_layers=4 model.pattern=GGGS``) train their two kinds of
layer; a bidirectional use of any of them is refused in one line before anything is written; and the diagnostics
read the effective (signed) matrix."""

from __future__ import annotations

import math
import sys

import pytest
from helpers import RECURRENT_SETTINGS, registered_here, run_cli, setting_overrides, train_listops, train_task
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from attnlab.forms import form_names_with, list_forms
from attnlab.tasks import list_tasks, task_class
from attnlab.training import CONF_DIR
from attnlab.training.config import ConfigError, validate_config

pytestmark = pytest.mark.usefixtures("restore_process_state")

# from the registry's tags, in registration order (retnet, gla, deltanet, gated_deltanet, kda and any form registered
# before collection)
PRESETS = [name for name in form_names_with("recurrent") if name not in form_names_with("linear")]
# each of them at its defaults and at each of its named settings (gla, gla_channel, gla_mamba2, deltanet, ...)
SETTINGS = [s for s in RECURRENT_SETTINGS if s.form in PRESETS]
# The tasks that allow a causal model, from the task registry. A task declares one thing about the mask:
# ``requires_causal`` (its labels are later input tokens, so a causal mask is the only one it takes); no task refuses a
# causal mask (the MAD tasks and MQAR label each position from the tokens at and before it, ListOps and Digits pool
# a per-sequence label), so every registered task allows one.
CAUSAL_TASKS = list_tasks()
# the settings trained on every one of those tasks (the others train on ListOps)
ON_EVERY_TASK = ("kda", "gla_channel", "deltaproduct", "rwkv7")
RUNS = [
    *((s, "listops") for s in SETTINGS if s.label not in ON_EVERY_TASK),
    *((s, task) for s in SETTINGS if s.label in ON_EVERY_TASK for task in CAUSAL_TASKS),
]
H, D_K = 2, 8  # train_task's d_model 16 and 2 heads: d_k = d_v = 8
ONE_LAYER = ["num_layers=1", "threads=1"]


def variant_overrides(name: str) -> list[str]:
    """``variant=<name>`` where conf/variant has the form's file, else the route of a registered name without one:
    ``variant=custom variant.name=<name>`` with no normalizer and the causal mask (what the forms' files set)."""
    if (CONF_DIR / "variant" / f"{name}.yaml").exists():
        return [f"variant={name}"]
    return ["variant=custom", f"variant.name={name}", "normalizer=none", "mask=causal"]


def preset_short_conv(form: str) -> int | None:
    """The short convolution's width that conf/variant/<form>.yaml sets (``model.short_conv``; kda's 4), or None."""
    return OmegaConf.select(OmegaConf.load(CONF_DIR / "variant" / f"{form}.yaml"), "model.short_conv")


def state_floats(short_conv: int | None, steps: int = 1) -> int:
    """A decay or delta-rule layer's decoding state per sequence: one d_k × d_v matrix per head, plus the short
    convolution's last k − 1 inputs of q, k and v (H·d_k channels each; DeltaProduct projects ``steps`` keys and
    values per token)."""
    return H * D_K * D_K + (0 if short_conv is None else (short_conv - 1) * (1 + 2 * steps) * H * D_K)


def test_the_runs_cover_every_setting_and_every_task():
    assert {s.label for s, _ in RUNS} == {s.label for s in SETTINGS} >= {"gla_channel", "kda", "kda_beta2"}
    for label in ON_EVERY_TASK:
        assert sorted(task for s, task in RUNS if s.label == label) == sorted(CAUSAL_TASKS)
    assert {"listops", "text", "digits", "associative_recall", "selective_copy"} <= set(CAUSAL_TASKS)
    assert task_class("text").requires_causal  # (a causal language model: among them)


@pytest.mark.parametrize(("setting", "task"), RUNS, ids=[f"{s.label}-{task}" for s, task in RUNS])
def test_every_setting_trains_causally_and_kda_and_channel_gla_on_every_task(tmp_path, setting, task):
    summary = train_task(tmp_path, task, *setting_overrides(setting), *ONE_LAYER)
    assert summary["status"] == "ok", summary["reason"]
    assert summary["task"] == task and summary["steps"] == 5
    assert summary["backends"] == ["chunked"]
    settings = summary["settings"]
    assert settings["score"] == setting.form and settings["normalizer"] == "none"
    assert settings["mask"] == {"name": "causal"}
    assert settings["score_params"].items() >= setting.params.items()  # the setting reached the layer
    assert settings["short_conv"] == preset_short_conv(setting.form)
    steps = settings["score_params"].get("householder_steps", 1)
    assert summary["state_size"] == [state_floats(settings["short_conv"], steps)]  # whatever the length
    assert math.isfinite(summary["metrics"]["train/loss"]) and math.isfinite(summary["metrics"]["test/loss"])
    assert math.isfinite(summary["metrics"]["attn/row_mass"])  # the diagnostics read the effective matrix


def test_a_users_form_in_one_module_trains_through_imports(tmp_path):
    """tests/user_form_example.py registers ``test_user_decay`` when ``imports=[user_form_example]`` imports it (not
    before: the registry does not have it), and the run trains that form on the chunked backend; the registry is
    put back afterwards."""
    assert "test_user_decay" not in list_forms() and "user_form_example" not in sys.modules
    with registered_here("user_form_example"):
        overrides = [*variant_overrides("test_user_decay"), "imports=[user_form_example]", *ONE_LAYER]
        summary = train_listops(tmp_path, *overrides)
        assert "test_user_decay" in form_names_with("recurrent")
    assert summary["status"] == "ok", summary["reason"]
    assert summary["backends"] == ["chunked"] and summary["settings"]["score"] == "test_user_decay"
    assert summary["state_size"] == [state_floats(None)]


@pytest.mark.parametrize("variant", ["gated_deltanet", "kda", "deltaproduct", "rwkv7"])
def test_a_hybrid_with_one_softmax_layer_in_four_trains(tmp_path, variant):
    """``model.pattern=GGGS``: three layers of the variant (G) and one scaled_dot softmax layer (S), as Qwen3-Next
    and OLMo Hybrid run Gated DeltaNet and Kimi Linear runs KDA (with MLA where this has scaled_dot)."""
    overrides = [f"variant={variant}", "num_layers=4", "model.pattern=GGGS", "model.short_conv=4", "threads=1"]
    summary = train_listops(tmp_path, *overrides)
    assert summary["status"] == "ok", summary["reason"]
    assert summary["backends"] == ["chunked", "chunked", "chunked", "sdpa"]
    assert [layer.get("score") for layer in summary["layers"]] == [variant, variant, variant, None]
    assert all(layer["short_conv"] == 4 for layer in summary["layers"][:3])
    assert summary["layers"][3] == {"mask": {"name": "causal"}}  # a softmax scaled_dot layer, as the defaults
    assert summary["state_size"][:3] == [state_floats(4, 2 if variant == "deltaproduct" else 1)] * 3
    assert math.isfinite(summary["metrics"]["train/loss"])


@pytest.mark.parametrize("mask", ["none", "sliding_window"])
@pytest.mark.parametrize("variant", PRESETS)
def test_a_bidirectional_use_is_refused_in_one_line(variant, mask):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"variant={variant}", f"mask={mask}"])
    with pytest.raises(ConfigError, match=f"variant {variant} is causal only") as err:
        validate_config(cfg)
    assert "\n" not in str(err.value)


def test_a_bidirectional_kda_command_exits_2_with_one_line_and_writes_nothing(tmp_path):
    """``python train.py variant=kda mask=none`` (the command line, in this process): exit code 2, one line on
    stderr, no run folder."""
    proc = run_cli("variant=kda", "mask=none", "logger=none", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "variant kda is causal only" in lines[0], lines
    assert "Traceback" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == [], sorted(str(p) for p in tmp_path.rglob("*"))
