"""The decay and delta-rule presets train end to end: each of ``variant=retnet|gla|deltanet|gated_deltanet`` runs
``debug=fast`` to status ok under ``mask=causal`` on ListOps (right-padded: causal AND key padding) on the chunked
backend, with its state size H·d_k·d_v recorded; a hybrid with one softmax layer in four trains its two kinds of
layer; a bidirectional use is refused in one line before anything is written; and the diagnostics read the
effective (signed) matrix."""

from __future__ import annotations

import pytest
from helpers import train_listops
from hydra import compose, initialize_config_dir

from attnlab.training import CONF_DIR
from attnlab.training.config import ConfigError, validate_config

pytestmark = pytest.mark.usefixtures("restore_process_state")

PRESETS = ["retnet", "gla", "deltanet", "gated_deltanet"]


@pytest.mark.parametrize("variant", PRESETS)
def test_every_decay_and_delta_rule_preset_trains_causally(tmp_path, variant):
    summary = train_listops(tmp_path, f"variant={variant}", "num_layers=1")
    assert summary["status"] == "ok", summary["reason"]
    assert summary["backends"] == ["chunked"]
    settings = summary["settings"]
    assert settings["score"] == variant and settings["normalizer"] == "none" and settings["mask"] == {"name": "causal"}
    assert summary["state_size"] == [2 * 8 * 8]  # H·d_k·d_v, whatever the length
    assert summary["metrics"]["attn/row_mass"] == summary["metrics"]["attn/row_mass"]  # (not NaN)


def test_a_gated_deltanet_hybrid_with_one_softmax_layer_in_four_trains(tmp_path):
    overrides = ["variant=gated_deltanet", "num_layers=4", "model.pattern=GGGS", "model.short_conv=4"]
    summary = train_listops(tmp_path, *overrides)
    assert summary["status"] == "ok", summary["reason"]
    assert summary["backends"] == ["chunked", "chunked", "chunked", "sdpa"]
    assert summary["layers"][0]["score"] == "gated_deltanet" and summary["layers"][0]["short_conv"] == 4
    assert summary["layers"][3] == {"mask": {"name": "causal"}}  # a softmax scaled_dot layer, as the defaults


@pytest.mark.parametrize("mask", ["none", "sliding_window"])
def test_a_bidirectional_use_is_refused_in_one_line(mask):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["variant=deltanet", f"mask={mask}"])
    with pytest.raises(ConfigError, match="variant deltanet is causal only") as err:
        validate_config(cfg)
    assert "\n" not in str(err.value)
