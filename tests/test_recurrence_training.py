"""The decay and delta-rule presets train end to end: each of ``variant=retnet|gla|deltanet|gated_deltanet`` (every
recurrent form of the registry beside linear attention, from its tags) runs ``debug=fast`` to status ok under
``mask=causal`` on ListOps (right-padded: causal AND key padding) on the chunked backend, with its state size
H·d_k·d_v recorded; a user's form trains through ``imports=[module]``; a hybrid with one softmax layer in four
trains its two kinds of layer; a bidirectional use is refused in one line before anything is written; and the
diagnostics read the effective (signed) matrix."""

from __future__ import annotations

import sys

import pytest
from helpers import train_listops
from hydra import compose, initialize_config_dir

from attnlab.forms import _FORMS, _ORDER, form_names_with, list_forms
from attnlab.training import CONF_DIR
from attnlab.training.config import ConfigError, validate_config

pytestmark = pytest.mark.usefixtures("restore_process_state")

# from the registry's tags, in registration order (retnet, gla, deltanet, gated_deltanet and any form registered
# before collection)
PRESETS = [name for name in form_names_with("recurrent") if name not in form_names_with("linear")]


def variant_overrides(name: str) -> list[str]:
    """``variant=<name>`` where conf/variant has the form's file, else the route of a registered name without one:
    ``variant=custom variant.name=<name>`` with no normalizer and the causal mask (what the forms' files set)."""
    if (CONF_DIR / "variant" / f"{name}.yaml").exists():
        return [f"variant={name}"]
    return ["variant=custom", f"variant.name={name}", "normalizer=none", "mask=causal"]


@pytest.mark.parametrize("variant", PRESETS)
def test_every_decay_and_delta_rule_preset_trains_causally(tmp_path, variant):
    summary = train_listops(tmp_path, *variant_overrides(variant), "num_layers=1")
    assert summary["status"] == "ok", summary["reason"]
    assert summary["backends"] == ["chunked"]
    settings = summary["settings"]
    assert settings["score"] == variant and settings["normalizer"] == "none" and settings["mask"] == {"name": "causal"}
    assert summary["state_size"] == [2 * 8 * 8]  # H·d_k·d_v, whatever the length
    assert summary["metrics"]["attn/row_mass"] == summary["metrics"]["attn/row_mass"]  # (not NaN)


def test_a_users_form_in_one_module_trains_through_imports(tmp_path):
    """tests/user_form_example.py registers ``test_user_decay`` when ``imports=[user_form_example]`` imports it (not
    before: the registry does not have it), and the run trains that form on the chunked backend; the registry is
    put back afterwards."""
    assert "test_user_decay" not in list_forms() and "user_form_example" not in sys.modules
    before = list_forms()
    try:
        overrides = [*variant_overrides("test_user_decay"), "imports=[user_form_example]", "num_layers=1"]
        summary = train_listops(tmp_path, *overrides)
        assert "test_user_decay" in form_names_with("recurrent")
    finally:
        for name in [n for n in list_forms() if n not in before]:
            _FORMS._entries.pop(name, None)
            _ORDER.remove(name)
        sys.modules.pop("user_form_example", None)
    assert summary["status"] == "ok", summary["reason"]
    assert summary["backends"] == ["chunked"] and summary["settings"]["score"] == "test_user_decay"
    assert summary["state_size"] == [2 * 8 * 8]


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
