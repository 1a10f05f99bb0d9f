"""Signed weights from the form (issue 60): the diagnostics ask each layer's form (``Form.weights_signed()``), so a
delta-rule, RWKV-7, MTA or differential layer logs no entropy or saturation (NaN: null in ``metrics.jsonl``) and
says it is signed (``attn/L{l}/signed``), while a softmax layer of the same model is scored as before; the
dashboard labels those layers wherever it shows entropy or saturation.

One tiny Lightning fit (a softmax, a gated DeltaNet and an MTA layer, 3 steps on tiny data) is shared by the module;
the rest reads its run folder or probes an untrained model."""

from __future__ import annotations

import html as html_lib
import io
import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from rich.console import Console

import attnlab.attention
from attnlab import dashboard
from attnlab.callbacks import AttentionDiagnostics, weights_signed
from attnlab.config import AttentionConfig
from attnlab.dashboard import build_html, load_runs
from attnlab.dashboard.cli import print_table
from attnlab.dashboard.load import Run
from attnlab.metrics import PROBABILITY_STATS, attention_stats
from attnlab.module import EncoderModule
from attnlab.runs import read_metrics
from attnlab.tasks import Digits
from attnlab.training.loggers import JsonlLogger

pytestmark = pytest.mark.usefixtures("single_thread")

HEADS = 2
SOFTMAX = AttentionConfig(mask="causal")
DELTA = AttentionConfig(score="gated_deltanet", normalizer="none", mask="causal")
MTA = AttentionConfig(score="mta", mask="causal")  # c_h = 2 for 2 heads: the head mixing gives signed weights
KEPT = ("attn_distance", "row_mass", "support", "first_mass", "logit_std", "logit_max")  # every layer has these


def _module(configs: list[AttentionConfig], num_train: int = 32) -> tuple[Digits, EncoderModule]:
    torch.manual_seed(0)
    dm = Digits(batch_size=16, num_train=num_train, num_val=16, num_test=16)
    dm.setup("fit")
    module = EncoderModule(
        dm.vocab_size, dm.num_classes, dm.per_token, dm.pad_id, dm.max_len, d_model=8, num_heads=HEADS,
        num_layers=len(configs), attention=configs, max_steps=3,
    )  # fmt: skip
    return dm, module


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, AttentionDiagnostics]:
    """A run folder: 3 steps of softmax / gated DeltaNet / MTA, diagnostics at step 0 and the end, its
    ``metrics.jsonl`` written by the run's own logger, a summary and a config beside it (as the dashboard reads)."""
    folder = tmp_path_factory.mktemp("signed") / "0_hybrid"
    folder.mkdir()
    dm, module = _module([SOFTMAX, DELTA, MTA])
    diag = AttentionDiagnostics(every_n_steps=0, probe_size=2, heatmaps=False)
    logger = JsonlLogger(folder)
    trainer = L.Trainer(
        max_steps=3, logger=logger, callbacks=[diag], enable_progress_bar=False, enable_checkpointing=False,
        limit_val_batches=0, enable_model_summary=False, accelerator="cpu", log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    logger.finalize("success")
    initial, final = diag.results()
    summary = {"status": "ok", "variant": "gated_deltanet", "task": "digits", "num_heads": HEADS, "num_layers": 3}
    summary |= {"seed": 0, "metrics": final, "attn_init": initial}
    (folder / "summary.json").write_text(json.dumps(summary, allow_nan=False, default=lambda _: None))
    (folder / "config.yaml").write_text(
        "variant:\n  name: gated_deltanet\n  params: {}\nmask:\n  name: causal\ntask:\n  name: digits\n"
        f"num_heads: {HEADS}\nnum_layers: 3\nseed: 0\n"
    )
    return folder, diag


def _diagnostics_rows(folder: Path) -> list[dict]:
    return [r for r in read_metrics(folder / "metrics.jsonl") if "attn/L0/entropy" in r]


def test_delta_rule_and_mta_layers_log_no_entropy_and_are_marked_signed(trained):
    folder, diag = trained
    rows = _diagnostics_rows(folder)
    assert [r["step"] for r in rows] == [0, 3]
    for row in rows:
        # the softmax layer: its rows are distributions, scored as always
        for metric in PROBABILITY_STATS:
            assert math.isfinite(row[f"attn/L0/{metric}"]), metric
            assert all(math.isfinite(row[f"attn/L0H{h}/{metric}"]) for h in range(HEADS)), metric
        assert 0.0 < row["attn/L0/entropy_norm"] <= 1.0
        # the gated DeltaNet and MTA layers: signed by their forms, so no entropy, max_prob or saturation (null)
        for layer in (1, 2):
            for metric in PROBABILITY_STATS:
                assert row[f"attn/L{layer}/{metric}"] is None, (layer, metric)
                assert all(row[f"attn/L{layer}H{h}/{metric}"] is None for h in range(HEADS)), (layer, metric)
        # ... and the logged metrics say which layers are signed; a signed layer always logs its negative mass
        assert row["attn/L0/signed"] == 0.0 and "attn/L0/negative_mass" not in row
        for layer in (1, 2):
            assert row[f"attn/L{layer}/signed"] == 1.0
            assert row[f"attn/L{layer}/negative_mass"] >= 0.0
        for layer in range(3):  # the raw-weight statistics stay, for every layer
            assert all(math.isfinite(row[f"attn/L{layer}/{metric}"]) for metric in KEPT), layer
        # the model means: of the softmax layer alone; a third of the layers signed
        assert row["attn/entropy"] == pytest.approx(row["attn/L0/entropy"])
        assert row["attn/saturation"] == pytest.approx(row["attn/L0/saturation"])
        assert row["attn/signed"] == pytest.approx(2 / 3)
    assert (rows[1]["attn/L1/negative_mass"] or 0.0) > 0.0  # the delta rule's weights really go negative
    initial, final = diag.results()
    for means in (initial, final):
        assert means["attn/signed"] == pytest.approx(2 / 3) and math.isfinite(means["attn/entropy_norm"])


@pytest.mark.parametrize(
    ("config", "signed"),
    [
        (AttentionConfig(score="rwkv7", normalizer="none", mask="causal"), True),
        (AttentionConfig(mask="causal", differential=True), True),
        (AttentionConfig(score="deltanet", normalizer="none", mask="causal"), True),
        (AttentionConfig(score="linear", score_params={"feature_map": "elu"}, normalizer="rowsum"), False),
    ],
    ids=["rwkv7", "differential", "deltanet", "linear"],
)
def test_the_form_says_which_layers_are_signed(config, signed):
    """Whatever the form (RWKV-7, differential, the delta rule; linear attention's row-sum rows are not signed by its
    form): its second layer is measured as its form says, beside a softmax layer."""
    dm, module = _module([SOFTMAX, config], num_train=16)
    layer = module.encoder.layers[1].self_attn
    assert weights_signed(layer) is signed is layer.form.weights_signed()
    diag = AttentionDiagnostics(probe_size=2)
    diag._probe = dm.probe_batch(2)[0]
    stats, _ = diag.compute(module)
    for metric in PROBABILITY_STATS:
        assert math.isnan(stats[f"attn/L1/{metric}"]) is signed, metric
        assert math.isfinite(stats[f"attn/L0/{metric}"]), metric
    assert ("attn/L1/negative_mass" in stats) is signed
    assert stats["attn/L1/signed"] == float(signed) and stats["attn/L0/signed"] == 0.0
    assert stats["attn/signed"] == (0.5 if signed else 0.0)
    if signed:
        assert stats["attn/entropy"] == pytest.approx(stats["attn/L0/entropy"])


def test_a_module_without_a_form_is_signed_by_its_differential_flag():
    plain = torch.nn.Linear(2, 2)
    assert weights_signed(plain) is False
    plain.differential = True
    assert weights_signed(plain) is True
    layer = attnlab.attention.MultiHeadAttention(8, 2, 4, differential=True, layer=1)
    assert weights_signed(layer) is True


def test_attention_stats_without_probability_rows_leave_out_only_the_distribution_statistics():
    g = torch.Generator().manual_seed(0)
    w = torch.softmax(torch.randn(2, 3, 5, 5, generator=g), dim=-1) - 0.1  # signed rows
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    logits = torch.randn(2, 3, 5, 5, generator=g)
    full = attention_stats(w, logits, mask, signed=True)
    signed = attention_stats(w, logits, mask, signed=True, probability_rows=False)
    assert set(signed) == set(full)
    for name, value in signed.items():
        if name in PROBABILITY_STATS:
            assert value.shape == (3,) and torch.isnan(value).all(), name
        else:
            torch.testing.assert_close(value, full[name], rtol=0, atol=0)
    with pytest.raises(TypeError, match="probability_rows"):
        attention_stats(w, probability_rows=None)


# ---------------------------------------------------------------------------------------------------- dashboard


def test_the_dashboard_labels_the_signed_layers(trained):
    folder, _ = trained
    (run,) = load_runs(folder.parent)
    assert dashboard.figures.signed_layers(run) == ((1, 2), 3)
    assert dashboard.figures.signed_note(run) == (
        "signed weights in layers 1, 2 of 3: no entropy or saturation there; the model's are of the other layers"
    )
    # the softmax layer's rows sum to 1: no "renormalised" note, although the model's row mass (with the delta
    # rule's) does not
    assert abs(run.final("attn/row_mass") - 1.0) > 0.01 and dashboard.figures.unnormalised(run) is None
    fig = dashboard.figures.head_figure(run, ["entropy_norm", "saturation", "induction"])
    notes = [a["text"] for a in fig["layout"]["annotations"]]
    assert any(t.startswith("Signed weights: no entropy or saturation in layers 1, 2") for t in notes)
    assert not any(t.startswith("Not a distribution") for t in notes)
    entropy = fig["data"][0]
    assert entropy["z"][0][0] is not None and entropy["z"][1] == entropy["z"][2] == [None] * HEADS
    assert entropy["text"][1] == entropy["text"][2] == ["signed"] * HEADS
    assert float(entropy["text"][0][0]) == pytest.approx(entropy["z"][0][0], abs=0.006)
    assert entropy["texttemplate"] == "%{text}"
    assert entropy["customdata"][1][0] == "signed weights, no entropy_norm"
    assert fig["layout"]["yaxis"]["ticktext"] == ["0", "1 (signed)", "2 (signed)"]
    html = html_lib.unescape(build_html([run]))
    init = html[html.index('<section id="init">') :]
    init = init[: init.index("</section>")]  # the step-0 diagnostics: entropy_norm, saturation, max_prob
    assert "No attn/entropy_norm, attn/saturation, attn/max_prob where the weights are signed" in init
    assert "(signed weights in layers 1, 2 of 3: no entropy or saturation there" in init
    assert "Not entropies of a distribution" not in html


def _signed_run(name: str, layers: int, signed: set[int]) -> Run:
    """A run in memory whose layers in ``signed`` logged no entropy or saturation (as a signed layer does)."""
    row: dict = {"step": 5}
    for layer in range(layers):
        value = None if layer in signed else 0.8
        row |= {f"attn/L{layer}/signed": float(layer in signed), f"attn/L{layer}/row_mass": 1.0}
        row |= {f"attn/L{layer}H0/entropy_norm": value, f"attn/L{layer}H0/saturation": value and 0.1}
    means = {"attn/entropy_norm": None if len(signed) == layers else 0.8, "attn/saturation": None, "test/acc": 0.5}
    summary = {"status": "ok", "variant": name, "seed": 0, "metrics": means}
    return Run(Path(name), name, {"variant": {"name": name}, "seed": 0}, summary, rows=[row])


def test_the_terminal_table_says_signed_where_no_layer_has_an_entropy():
    runs = [_signed_run("deltanet", 2, {0, 1}), _signed_run("hybrid", 2, {1}), _signed_run("dot", 2, set())]
    assert [dashboard.figures.signed_note(r) for r in runs] == [
        "signed weights in every layer: no entropy or saturation",
        "signed weights in layer 1 of 2: no entropy or saturation there; the model's are of the other layers",
        None,
    ]
    console = Console(file=io.StringIO(), width=160, color_system=None)
    print_table(runs, console)
    lines = {line.split()[0]: line for line in console.file.getvalue().splitlines() if line.strip()}
    assert "signed" in lines["deltanet"].split()  # ent_n of a run without one
    assert "signed" not in lines["hybrid"].split() and "signed" not in lines["dot"].split()
    # an older run (no signed marker) is read as before: nothing said
    old = Run(Path("old"), "old", {}, {"status": "ok", "metrics": {"attn/entropy_norm": 0.5}}, rows=[{"step": 1}])
    assert dashboard.figures.signed_layers(old) is None and dashboard.figures.signed_note(old) is None
