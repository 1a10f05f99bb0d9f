"""Per-layer attention: patterns of layer kinds (local/global hybrids), explicit per-layer lists, each layer with
its own mask, through the library and through Hydra's config."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_cfg

import attnlab
from attnlab.config import AttentionConfig, layer_configs, pattern_name
from attnlab.training.config import ConfigError, attention_configs, build_module, validate_config

pytestmark = pytest.mark.usefixtures("single_thread", "hydra_ctx")

LOCAL = {"mask": {"name": "and", "masks": ["base", {"name": "sliding_window", "window": 2}]}}


def test_a_pattern_repeats_and_is_cut_to_the_number_of_layers():
    base = AttentionConfig(mask="causal")
    kinds = {"L": LOCAL, "G": {}, "S": {"softcap": 5.0}}
    configs = layer_configs(base, 5, pattern="LGS", layer_kinds=kinds)
    assert [c.softcap for c in configs] == [None, None, 5.0, None, None]
    assert configs[1] == configs[4] == base  # G: the base config itself
    # L: the base mask AND a window ("base" stands for the base config's mask)
    assert configs[0].mask == {"name": "and", "masks": ["causal", {"name": "sliding_window", "window": 2}]}
    assert configs[3] == configs[0]
    assert pattern_name(configs, "LGS") == "LGS"
    assert pattern_name([base, base]) is None
    assert pattern_name([base, configs[0], base]) == "ABA"


def test_an_explicit_list_gives_each_layer_its_changes():
    configs = layer_configs(AttentionConfig(), 3, layers=[{"mask": "causal"}, {}, None])
    assert [c.mask for c in configs] == ["causal", None, None]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pattern": "LLLG"}, r"^model.pattern=LLLG has 4 layers, more than num_layers=2: set num_layers=4"),
        ({"pattern": "LX"}, r"^model.pattern=LX names layer kind 'X', which model.layer_kinds does not define"),
        ({"layers": [{}]}, r"^model.layers lists 1 layers, but num_layers is 2$"),
        ({"layers": [{}, {"qk_norm": "x"}]}, r"^model.layers\[1\]: qk_norm must be null, layernorm or rmsnorm"),
        ({"layers": [{}, {"soft_cap": 1}]}, r"^model.layers\[1\]: attention has no field 'soft_cap'"),
        ({"pattern": "LG", "layers": [{}, {}]}, r"^give model.pattern or model.layers, not both$"),
    ],
)
def test_bad_per_layer_settings_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        layer_configs(AttentionConfig(), 2, **kwargs)


def _reference_layers(enc, tokens, masks):
    """The encoder's forward pass written out: embedding, then each layer on its own mask, then the final norm."""
    h = enc.embed(tokens) + enc.pos(tokens.shape[1])
    for layer, mask in zip(enc.layers, masks, strict=True):
        h, _ = layer(h, mask)
    return enc.norm(h)


def test_each_layer_applies_its_own_mask_with_the_padding():
    """A local/global model: layer 1 windowed causal, layer 2 causal; the output equals the layers run one by one
    on dense masks built by hand (padding hidden in both), and a later token never changes an earlier output."""
    torch.manual_seed(0)
    configs = layer_configs(AttentionConfig(mask="causal"), 2, pattern="LG", layer_kinds={"L": LOCAL})
    enc = attnlab.Encoder(11, 16, 4, 2, pad_id=0, attention=configs).double()
    tokens = torch.tensor([[3, 4, 5, 6, 7, 0], [8, 9, 1, 2, 0, 0]])
    L = tokens.shape[1]
    keys = tokens != 0  # (B, L)
    causal = torch.tensor([[j <= i for j in range(L)] for i in range(L)])
    window = torch.tensor([[j <= i and i - j < 2 for j in range(L)] for i in range(L)])
    masks = [(m[None] & keys[:, None, :])[:, None] for m in (window, causal)]  # (B, 1, L, L)
    torch.testing.assert_close(enc(tokens), _reference_layers(enc, tokens, masks), rtol=1e-12, atol=1e-12)
    # the first layer really is local: with one layer, position 4 of row 0 cannot see position 0
    one = attnlab.Encoder(11, 16, 4, 1, attention=configs[:1]).double()
    changed = tokens.clone()
    changed[0, 0] = 10
    out, out2 = one(tokens), one(changed)
    assert not torch.allclose(out[0, 1], out2[0, 1])  # in the window
    torch.testing.assert_close(out[0, 4], out2[0, 4], rtol=0, atol=0)  # outside it


def test_layers_may_differ_in_any_field_and_diagnostics_stay_per_layer():
    configs = [AttentionConfig(score="additive"), AttentionConfig(normalizer="sigmoid", num_kv_heads=1)]
    enc = attnlab.Encoder(11, 16, 4, 2, attention=configs)
    assert type(enc.layers[0].self_attn.score).__name__ == "AdditiveScore"
    assert enc.layers[1].self_attn.num_kv_heads == 1
    _, records = enc(torch.randint(1, 11, (2, 5)), need_weights=True)
    assert len(records) == 2 and records[1].weights.shape == (2, 4, 5, 5)


def test_the_command_line_pattern_builds_local_and_global_layers():
    cfg = compose_cfg("task=text", "model.pattern=LG", "num_layers=4", "model.local_window=4")
    configs = attention_configs(cfg)
    local = {"name": "and", "masks": [{"name": "causal"}, {"name": "sliding_window", "window": 4}]}
    assert [c.mask for c in configs] == [local, {"name": "causal"}, local, {"name": "causal"}]
    datamodule = validate_config(cfg)
    module = build_module(cfg, datamodule)
    assert module.pattern == "LG" and len(module.hparams["attention"]) == 4


def test_the_command_line_layer_list_and_its_errors():
    cfg = compose_cfg("model.layers=[{mask: causal, softcap: 30}, {}]")
    assert [(c.mask, c.softcap) for c in attention_configs(cfg)] == [("causal", 30.0), (None, None)]
    with pytest.raises(ConfigError, match=r"^model.layers\[1\]: softcap must be a finite number > 0, got -1$"):
        validate_config(compose_cfg("model.layers=[{}, {softcap: -1}]"))
    with pytest.raises(ConfigError, match=r"^model.layers\[0\] \(mask none\) lets a position attend to later"):
        validate_config(compose_cfg("task=text", "model.layers=[{mask: none}, {}]"))
    with pytest.raises(ConfigError, match=r"^model.layer_kinds.L.mask"):
        validate_config(compose_cfg("model.pattern=LG", "model.local_window=0"))


def test_a_sweep_over_patterns_has_the_pattern_as_its_dimension(tmp_path):
    """Two run folders that differ in ``model.pattern`` (their configs also hold the layer kinds' lists of mask
    specs): the dashboard's one dimension is the pattern, and its CSV names it."""
    import json

    import yaml

    from attnlab.dashboard import load_runs
    from attnlab.dashboard.cli import write_csv
    from attnlab.dashboard.dims import Sweep
    from attnlab.runs import Summary
    from attnlab.training.config import plain

    for i, pattern in enumerate(["G", "LG"]):
        cfg = compose_cfg("task=text", "num_layers=2", f"model.pattern={pattern}")
        folder = tmp_path / f"{i}_{pattern}"
        folder.mkdir()
        (folder / "config.yaml").write_text(yaml.safe_dump(plain(cfg), sort_keys=False))
        summary = Summary(status="ok", variant="scaled_dot", task="text", pattern=pattern, metrics={"test/acc": 0.5})
        (folder / "summary.json").write_text(json.dumps(summary.to_dict()))
    runs = load_runs(tmp_path)
    assert [d.key for d in Sweep(runs).dims] == ["model.pattern"]
    rows = write_csv(runs, tmp_path / "runs.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert [row.split(",")[header.index("pattern")] for row in rows[1:]] == ["G", "LG"]
