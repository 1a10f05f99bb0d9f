"""Linear attention trains end to end: every feature map under every mask the O(L) backends compute (none, causal,
padding) runs ``debug=fast`` to status ok on ListOps (right-padded sequences of several lengths), on the backend the
mask calls for, with the state size recorded; Based's preset trains its two kinds of layer; and a multirun over
feature maps finishes (a subprocess)."""

from __future__ import annotations

import pytest
from helpers import read_summary, run_folders, run_train, train_listops
from hydra import compose

from attnlab.dashboard import load_run
from attnlab.feature_maps import list_feature_maps
from attnlab.training.config import ConfigError, validate_config

pytestmark = pytest.mark.usefixtures("restore_process_state")

MAPS = sorted(set(list_feature_maps()) - {"square"})  # (square is taylor)
BACKEND = {"none": "global", "padding": "global", "causal": "chunked"}


@pytest.mark.parametrize("mask", sorted(BACKEND))
@pytest.mark.parametrize("feature_map", MAPS)
def test_every_feature_map_trains_under_every_mask_an_o_of_l_backend_computes(tmp_path, feature_map, mask):
    summary = train_listops(
        tmp_path, "variant=linear", f"variant.params.feature_map={feature_map}", f"mask={mask}", "num_layers=1"
    )
    assert summary["status"] == "ok", summary["reason"]
    assert summary["backends"] == [BACKEND[mask]]
    assert summary["settings"]["score_params"]["feature_map"] == feature_map
    assert summary["settings"]["normalizer"] == "rowsum"
    assert len(summary["state_size"]) == 1 and summary["state_size"][0] > 0
    assert 0.0 <= summary["metrics"]["attn/entropy_norm"] <= 1.0  # the diagnostics read the quadratic weights


@pytest.mark.parametrize("normalizer", ["rowsum", "none"])
def test_both_linear_normalizers_train_and_their_row_mass_says_which(tmp_path, normalizer):
    """rowsum: each row of the (effective) weights sums to 1 (up to ε); none: to Σ_j φ(q_i)·φ(k_j) > 0."""
    summary = train_listops(tmp_path, "variant=linear", f"normalizer={normalizer}", "mask=causal", "num_layers=1")
    assert summary["status"] == "ok", summary["reason"]
    assert summary["backends"] == ["chunked"] and summary["settings"]["normalizer"] == normalizer
    mass = summary["metrics"]["attn/row_mass"]
    assert abs(mass - 1) < 1e-4 if normalizer == "rowsum" else mass > 0, mass


def test_based_trains_taylor_linear_layers_with_short_convolutions_beside_windowed_softmax(tmp_path):
    summary = train_listops(tmp_path, "variant=based", "mask=causal", "num_layers=3", "model.local_window=8")
    assert summary["status"] == "ok", summary["reason"]
    assert summary["pattern"] == "TW"
    assert summary["backends"] == ["chunked", "tiled", "chunked"]  # (the window: attnlab's tiled kernel)
    linear, softmax = summary["layers"][0], summary["layers"][1]
    assert linear["score_params"] == {"feature_map": "taylor", "feature_dim": 16} and linear["short_conv"] == 3
    assert softmax.get("score", "scaled_dot") == "scaled_dot" and "short_conv" not in softmax and "mask" in softmax
    # the windowed softmax layer caches its 8 keys, the linear layer its fixed state
    assert summary["state_size"][1] == 8 * 2 * 16
    assert load_run(tmp_path).state_size == sum(summary["state_size"])  # the dashboard's state column


@pytest.mark.slow
def test_a_multirun_over_feature_maps_finishes(tmp_path):
    sweep = tmp_path / "sweep"
    run_train(
        "-m",
        "variant=linear",
        "variant.params.feature_map=elu,taylor,performer",
        "mask=causal",
        "debug=fast",
        "logger=none",
        f"hydra.sweep.dir={sweep}",
        returncode=0,
    )
    summaries = [read_summary(folder) for folder in run_folders(sweep)]
    assert sorted(s["settings"]["score_params"]["feature_map"] for s in summaries) == ["elu", "performer", "taylor"]
    assert all(s["status"] == "ok" and s["backends"] == ["chunked", "chunked"] for s in summaries)


def test_long_sequences_that_the_quadratic_form_cannot_hold_are_not_refused_for_o_of_l_linear_layers(hydra_ctx):
    """The memory check charges a linear layer on chunked or global O(L), and the (B, H, L, L) weights only where
    the quadratic form computes it (here: forced eager)."""
    long = ["task=associative_recall", "task.datamodule.seq_len=20000", "mask=causal", "diagnostics.enabled=false"]
    validate_config(compose("config", overrides=[*long, "variant=linear"]))
    with pytest.raises(ConfigError, match=r"sequences of 20000 tokens need about .* a training batch's attention"):
        validate_config(compose("config", overrides=[*long, "variant=linear", "attention.backend=eager"]))
