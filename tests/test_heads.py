"""What the heads do (attnlab.heads): head-type scores, rank collapse and dilution against hand-built attention maps
and plain loops, head gates on every backend, head importance against finite differences of the loss, pruning
curves, and pruning.json as untrusted input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import make_mha, randomize_

import attnlab
from attnlab.heads import (
    HEAD_SCORES,
    dilution,
    head_gates,
    head_importance,
    head_scores,
    head_type,
    importance_order,
    pruning_curve,
    random_order,
    rank_residual,
    repeated_tokens,
)
from attnlab.runs import RunFileError, RunFolder, check_pruning

T = 6  # half the probe: [x; x] of 2T tokens


def _probe(batch: int = 2, half: int = T, seed: int = 0) -> torch.Tensor:
    return repeated_tokens(batch, half, range(1, 40), torch.Generator().manual_seed(seed))


def _map(rows: dict[int, int], L: int, fill: str = "self") -> torch.Tensor:
    """A one-hot (1, 1, L, L) attention map: row i on key rows[i], the other rows on themselves."""
    w = torch.zeros(1, 1, L, L, dtype=torch.float64)
    for i in range(L):
        w[0, 0, i, rows.get(i, i)] = 1.0
    return w


def _causal(L: int) -> torch.Tensor:
    return torch.ones(L, L, dtype=torch.bool).tril()


# ---------------------------------------------------------------------------------------------- the probe


def test_repeated_tokens_repeat_a_random_half_without_replacement_when_they_can():
    tokens = repeated_tokens(5, 7, range(3, 30), torch.Generator().manual_seed(1))
    assert tokens.shape == (5, 14)
    assert torch.equal(tokens[:, :7], tokens[:, 7:])
    assert ((tokens >= 3) & (tokens < 30)).all()
    assert all(len(set(row[:7].tolist())) == 7 for row in tokens)  # no token twice in a half
    small = repeated_tokens(50, 7, [1, 2], torch.Generator().manual_seed(1))  # fewer tokens than the half: repeats
    assert set(small.unique().tolist()) == {1, 2}


def test_task_probe_is_seeded_and_skipped_for_pixels():
    from helpers import small

    mqar = small("associative_recall", {"num_train": 64, "num_val": 16, "num_test": 16}, seed=3)
    a, b = mqar.repeated_probe(4), mqar.repeated_probe(4)
    assert torch.equal(a, b) and a.shape == (4, 2 * (mqar.seq_len // 2))
    assert (a != mqar.pad_id).all() and (a < mqar.vocab_size).all()
    digits = small("digits", {"num_val": 16, "num_test": 16})
    assert digits.repeated_probe(4) is None and "pixel" in digits.no_token_probe


# ---------------------------------------------------------------------------------------------- head-type scores


def test_a_pure_previous_token_head_scores_one_on_that_and_zero_on_induction():
    tokens = _probe(1)
    L = 2 * T
    w = _map({i: i - 1 for i in range(1, L)}, L)  # row 0 on itself (it has no previous token)
    s = head_scores(w, tokens, _causal(L))
    assert s["prev_token"].item() == 1.0
    assert s["induction"].item() == 0.0 and s["duplicate"].item() == 0.0
    assert s["local"].item() == 1.0
    assert head_type({k: float(v) for k, v in s.items()}) == ("prev_token", 1.0)


def test_a_pure_induction_head_scores_one_on_induction_only():
    tokens = _probe(1)
    L = 2 * T
    w = _map({T + t: t + 1 for t in range(T)}, L)  # second half: the token after the earlier copy
    s = head_scores(w, tokens, _causal(L), window=1)
    assert s["induction"].item() == 1.0
    assert s["duplicate"].item() == 0.0 and s["prev_token"].item() == 0.0
    assert s["local"].item() == pytest.approx(T / L)  # only the first half's rows (on themselves) are local
    assert head_type({k: float(v) for k, v in s.items()})[0] == "induction"


def test_a_pure_duplicate_token_head_scores_one_on_duplicate_only():
    tokens = _probe(1)
    L = 2 * T
    w = _map({T + t: t for t in range(T)}, L)  # second half: the earlier copy itself
    s = head_scores(w, tokens, _causal(L), window=1)
    assert s["duplicate"].item() == 1.0
    assert s["induction"].item() == 0.0 and s["prev_token"].item() == 0.0
    assert head_type({k: float(v) for k, v in s.items()})[0] == "duplicate"


def _scores_loop(w, tokens, visible, window):
    """The head-type scores written plainly: per row, its distribution over visible keys, the pattern's mass."""
    B, H, L, _ = w.shape
    out = {}
    for name in HEAD_SCORES:
        per_head = []
        for h in range(H):
            total, rows = 0.0, 0
            for b in range(B):
                t = tokens[b].tolist()
                for i in range(L):
                    keys = [j for j in range(L) if visible[b, h, i, j]]
                    pos = {j: max(float(w[b, h, i, j]), 0.0) for j in keys}
                    mass = sum(pos.values())
                    if not keys or mass <= 0:
                        continue

                    def on(j, i=i, t=t, name=name):
                        if name == "prev_token":
                            return j == i - 1
                        if name == "duplicate":
                            return j < i and t[j] == t[i]
                        if name == "induction":
                            return 1 <= j <= i and t[j - 1] == t[i]
                        return abs(i - j) <= window

                    pattern = [j for j in keys if on(j)]
                    if not pattern:
                        continue
                    total += sum(pos[j] for j in pattern) / mass
                    rows += 1
            per_head.append(total / rows if rows else math.nan)
        out[name] = torch.tensor(per_head, dtype=torch.float64)
    return out


@pytest.mark.parametrize("signed", [False, True])
def test_head_scores_match_a_loop_on_random_maps_with_repeated_tokens(signed):
    """Random weights (softmax rows, or signed ones), tokens from a small vocabulary (so duplicates and induction
    targets fall anywhere, several per row), a sliding-window-and-causal mask."""
    gen = torch.Generator().manual_seed(7)
    B, H, L = 3, 2, 11
    tokens = torch.randint(1, 4, (B, L), generator=gen)
    logits = torch.randn(B, H, L, L, generator=gen, dtype=torch.float64)
    i = torch.arange(L)
    mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= 6)
    w = torch.softmax(logits.masked_fill(~mask, -math.inf), dim=-1)
    if signed:
        w = w - 0.08
    got = head_scores(w, tokens, mask, window=2)
    want = _scores_loop(w, tokens, mask.expand(B, H, L, L), 2)
    for name in HEAD_SCORES:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)


def test_a_score_with_no_row_to_measure_is_nan():
    tokens = torch.arange(1, 9)[None]  # no token twice: no duplicate, no induction target
    w = torch.full((1, 2, 8, 8), 1 / 8, dtype=torch.float64)
    s = head_scores(w, tokens)
    assert torch.isnan(s["duplicate"]).all() and torch.isnan(s["induction"]).all()
    assert s["prev_token"].tolist() == pytest.approx([1 / 8, 1 / 8])


def test_head_type_names_specific_types_before_local_and_none_below_the_threshold():
    assert head_type({"prev_token": 0.7, "duplicate": 0.1, "induction": 0.2, "local": 0.9}) == ("prev_token", 0.7)
    assert head_type({"prev_token": 0.2, "duplicate": 0.1, "induction": 0.1, "local": 0.6}) == ("local", 0.6)
    assert head_type({"prev_token": 0.2, "duplicate": 0.3, "induction": math.nan, "local": 0.35}) == ("none", 0.35)
    assert head_type({"prev_token": 0.5, "induction": 0.55}, threshold=0.5) == ("induction", 0.55)


# ---------------------------------------------------------------------------------------------- rank collapse


def test_rank_residual_against_a_hand_computation_with_padding():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    ratios = []
    for b in range(3):
        rows = [x[b, i].tolist() for i in range(5) if keep[b, i]]
        mean = [sum(r[c] for r in rows) / len(rows) for c in range(4)]
        res = math.sqrt(sum((r[c] - mean[c]) ** 2 for r in rows for c in range(4)))
        norm = math.sqrt(sum(r[c] ** 2 for r in rows for c in range(4)))
        ratios.append(res / norm)
    assert rank_residual(x, keep).item() == pytest.approx(sum(ratios) / 3, rel=1e-12)


def test_rank_residual_is_zero_for_identical_tokens_and_one_for_tokens_averaging_to_zero():
    same = torch.randn(1, 1, 6, dtype=torch.float64).expand(2, 7, 6)
    assert rank_residual(same).item() == pytest.approx(0.0, abs=1e-12)
    centred = torch.randn(2, 7, 6, dtype=torch.float64)
    centred = centred - centred.mean(dim=1, keepdim=True)
    assert rank_residual(centred).item() == pytest.approx(1.0, rel=1e-12)


# ---------------------------------------------------------------------------------------------- dilution


def test_dilution_against_a_loop_and_a_uniform_row():
    gen = torch.Generator().manual_seed(4)
    B, H, L, k = 2, 3, 9, 3
    mask = _causal(L)
    w = torch.softmax(torch.randn(B, H, L, L, generator=gen, dtype=torch.float64).masked_fill(~mask, -math.inf), -1)
    got = dilution(w, mask, near=k)
    for h in range(H):
        near_sum, local_sum, rows = 0.0, 0.0, 0
        for b in range(B):
            for i in range(L):
                keys = [j for j in range(L) if mask[i, j]]
                if len(keys) <= k:
                    continue
                nearest = sorted(keys, key=lambda j, i=i: (abs(i - j), j))[:k]
                mass = sum(float(w[b, h, i, j]) for j in nearest)
                near_sum += mass
                local_sum += mass / (k / len(keys))
                rows += 1
        assert got["near_mass"][h].item() == pytest.approx(near_sum / rows, rel=1e-12)
        assert got["locality"][h].item() == pytest.approx(local_sum / rows, rel=1e-12)
    uniform = mask.double() / mask.sum(-1, keepdim=True)
    flat = dilution(uniform[None, None], mask, near=k)
    assert flat["locality"].item() == pytest.approx(1.0)


def test_dilution_breaks_ties_toward_earlier_keys_without_a_mask():
    w = torch.zeros(1, 1, 5, 5, dtype=torch.float64)
    w[0, 0, 2, 1] = 1.0  # row 2's nearest 2 keys are 2 and 1 (1 before 3): all its weight is near
    w[0, 0, [0, 1, 3, 4], [4, 4, 0, 0]] = 1.0  # the other rows far away
    got = dilution(w, near=2)
    assert got["near_mass"].item() == pytest.approx(1 / 5)  # only row 2 of 5 keeps its weight near


# ---------------------------------------------------------------------------------------------- gates


GATED = [
    ("scaled_dot", {}),
    ("additive", {}),
    ("scaled_dot", {"num_kv_heads": 1, "mask": "causal"}),
    ("scaled_dot", {"differential": True}),
    ("linear", {"normalizer": "rowsum", "mask": "causal"}),
    ("gla", {"normalizer": "none", "mask": "causal"}),
]


@pytest.mark.parametrize(("score", "options"), GATED, ids=[f"{s}-{sorted(o)}" for s, o in GATED])
def test_head_gates_scale_each_head_on_every_backend(score, options):
    """out(ξ) − out(0) is Σ_h ξ_h (out(e_h) − out(0)): each head's contribution scaled by its gate; ξ = 0 leaves the
    output projection's bias; the fast path and the eager path agree under gates."""
    H = 3
    mha = make_mha(12, H, 4, score=score, **options)
    x = torch.randn(2, 7, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    mask = attnlab.build_mask("causal") if options.get("mask") == "causal" else None

    def out(gate, eager=False):
        with head_gates([mha], [torch.tensor(gate, dtype=torch.float64)]):
            return mha.attend(x, mask=mask).out if eager else mha(x, mask=mask)[0]

    zero = out([0.0] * H)
    torch.testing.assert_close(zero, mha.out_proj.bias.expand_as(zero))
    gate = [0.3, -1.2, 2.0]
    parts = sum(g * (out([float(h == k) for k in range(H)]) - zero) for h, g in enumerate(gate))
    torch.testing.assert_close(out(gate) - zero, parts, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out(gate), out(gate, eager=True), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out([1.0] * H), mha(x, mask=mask)[0], rtol=0, atol=0)  # ξ = 1 changes nothing
    assert mha.head_gate is None  # restored


def test_head_gates_refuse_a_wrong_shape():
    mha = attnlab.MultiHeadAttention(8, 2, 4)
    with pytest.raises(ValueError, match="2 heads got gates of shape"), head_gates([mha], [torch.ones(3)]):
        pass
    with pytest.raises(ValueError, match="1 gate vectors for 2 layers"), head_gates([mha, mha], [torch.ones(2)]):
        pass


# ---------------------------------------------------------------------------------------------- importance


def _tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    enc = attnlab.Encoder(11, 8, 2, 2, mask="causal").double()
    randomize_(enc, seed, scale=0.4)
    head = randomize_(torch.nn.Linear(8, 11).double(), seed + 1)
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(1, 11, (3, 6), generator=gen), torch.randint(0, 11, (3, 6), generator=gen))]
    batches.append((torch.randint(1, 11, (2, 6), generator=gen), torch.randint(0, 11, (2, 6), generator=gen)))

    def loss(batch):
        tokens, labels = batch
        return torch.nn.functional.cross_entropy(head(enc(tokens)).flatten(0, 1), labels.flatten())

    return enc, loss, batches


def test_head_importance_is_the_finite_difference_of_the_loss_in_each_gate():
    enc, loss, batches = _tiny_model()
    got = head_importance(enc.layers, loss, batches, num_heads=2)
    eps = 1e-6
    for layer in range(2):
        for head in range(2):
            per_batch = []
            for batch in batches:
                values = []
                for sign in (1, -1):
                    gates = torch.ones(2, 2, dtype=torch.float64)
                    gates[layer, head] += sign * eps
                    with torch.no_grad(), head_gates(enc.layers, list(gates)):
                        values.append(float(loss(batch)))
                per_batch.append(abs(values[0] - values[1]) / (2 * eps))
            assert got[layer, head].item() == pytest.approx(sum(per_batch) / 2, rel=1e-6)
    assert all(p.grad is None for p in enc.parameters())  # the model's gradients are untouched


def test_importance_order_normalises_each_layer_then_sorts_ascending():
    importance = torch.tensor([[3.0, 4.0], [0.1, 0.0]])  # layer 0: norm 5 → 0.6, 0.8; layer 1: norm 0.1 → 1, 0
    assert importance_order(importance) == [(1, 1), (0, 0), (0, 1), (1, 0)]
    assert importance_order(importance, normalize=False) == [(1, 1), (1, 0), (0, 0), (0, 1)]
    order = random_order(3, 4, seed=0)
    assert sorted(order) == [(layer, head) for layer in range(3) for head in range(4)]
    assert order == random_order(3, 4, seed=0) != random_order(3, 4, seed=1)


def test_pruning_curve_removes_heads_in_order_and_starts_unpruned():
    enc, loss, batches = _tiny_model(1)
    seen = []

    def evaluate():
        seen.append([None if m.self_attn.head_gate is None else m.self_attn.head_gate.tolist() for m in enc.layers])
        with torch.no_grad():
            return {"loss": float(loss(batches[0]))}

    with torch.no_grad():
        unpruned = float(loss(batches[0]))
    curve = pruning_curve(enc.layers, evaluate, [(1, 0), (0, 1), (0, 0), (1, 1)], num_heads=2)
    assert [p["removed"] for p in curve] == [0, 1, 2, 3, 4]
    assert curve[0]["loss"] == unpruned  # bit for bit: every gate 1
    assert seen[2] == [[1.0, 0.0], [0.0, 1.0]]
    assert seen[4] == [[0.0, 0.0], [0.0, 0.0]]


# ---------------------------------------------------------------------------------------------- pruning.json


def _pruning(layers=2, heads=2):
    curve = [{"removed": k, "acc": 1.0 - k / 10, "loss": 0.1 * k} for k in range(layers * heads + 1)]
    return {
        "schema_version": 1,
        "metric": "acc",
        "num_layers": layers,
        "num_heads": heads,
        "importance": [[0.5] * heads for _ in range(layers)],
        "curves": {"importance": [curve], "random": [curve, curve]},
    }


def test_pruning_json_round_trips_and_bad_files_are_one_line_problems(tmp_path):
    folder = RunFolder(tmp_path)
    folder.write_pruning(_pruning())
    read = folder.read_pruning()
    assert read["curves"]["random"][1] == [1.0, 0.9, 0.8, 0.7, 0.6] and read["higher_is_better"]
    spoilt = [
        ("[]", "not a JSON object"),
        (json.dumps({**_pruning(), "metric": "<b>"}), "metric must be acc or bpc"),
        (json.dumps({**_pruning(), "num_heads": 10**9}), "num_heads must be an integer"),
        (json.dumps({**_pruning(), "importance": [[1, "x"], [1, 2]]}), "importance must be 2 lists"),
        (json.dumps({**_pruning(), "curves": {"importance": [[{"removed": 0, "acc": 1}]]}}), "must have 5 points"),
        (json.dumps({**_pruning(), "curves": {"other": []}}), "curves must be an object"),
        ('{"metric": "acc", "num_layers": 1, "num_heads": 1, "importance": [[NaN]]}', "finite numbers"),
    ]
    for text, problem in spoilt:
        folder.pruning_path.write_text(text)
        with pytest.raises(RunFileError, match=problem) as info:
            folder.read_pruning()
        assert "\n" not in str(info.value)
    folder.pruning_path.unlink()
    folder.pruning_path.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(RunFileError, match="symbolic link"):
        folder.read_pruning()
    with pytest.raises(RunFileError, match="heads: more than"):
        check_pruning({**_pruning(), "num_layers": 100, "num_heads": 100})


# ---------------------------------------------------------------------------------------------- in a run


def test_a_run_logs_head_scores_and_writes_pruning_curves_from_its_test_metric(tmp_path, restore_process_state):
    """A real (in-process) MQAR run: head-type scores per head at every probe, importance per head at the end, and
    pruning.json whose first point is the run's own test/acc (the trainer tested 1 batch: so does the curve)."""
    from hydra import compose, initialize_config_dir

    from attnlab.runs import read_metrics
    from attnlab.training import CONF_DIR, run

    overrides = [
        "task=associative_recall",
        "debug=fast",
        "logger=none",
        "results_table=false",
        "d_model=16",
        "num_heads=2",
        "trainer.limit_test_batches=1",
        "diagnostics.random_orders=2",
        "diagnostics.importance=true",  # (auto: off in a smoke run)
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        run(compose("config", overrides=overrides), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok"
    pruning = RunFolder(tmp_path).read_pruning()
    assert pruning["metric"] == "acc" and pruning["num_layers"] == 2 and pruning["num_heads"] == 2
    assert pruning["curves"]["importance"][0][0] == summary["metrics"]["test/acc"]
    assert len(pruning["curves"]["random"]) == 2
    assert summary["metrics"]["prune/auc_importance"] == pytest.approx(sum(pruning["curves"]["importance"][0]) / 5)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    probes = [r for r in rows if "attn/L1H1/induction" in r]
    assert [r["step"] for r in probes] == [0, 5]
    assert {f"attn/L{l}H{h}/{s}" for l in range(2) for h in range(2) for s in HEAD_SCORES} <= set(probes[-1])
    assert 0.0 <= probes[-1]["attn/induction_max"] <= 1.0
    assert any("attn/L0H1/importance" in r for r in rows)
    assert "induction_max" not in summary["attn_init"] and "attn/induction_max" in summary["attn_init"]


def test_the_callbacks_rank_collapse_reads_the_state_after_attention():
    """With the FFN zeroed, a pre-LN layer's output is exactly the state after its attention (x + attention(x)):
    the logged rank_residual is that state's, rank_residual_attn the attention output's alone."""
    from helpers import small

    from attnlab.callbacks import AttentionDiagnostics
    from attnlab.module import EncoderModule

    task = small("associative_recall", {"num_train": 32, "num_val": 8, "num_test": 8, "batch_size": 8})
    torch.manual_seed(0)
    module = EncoderModule(task.vocab_size, task.num_classes, task.per_token, task.pad_id, task.max_len, d_model=16)
    for layer in module.encoder.layers:
        torch.nn.init.zeros_(layer.ff[2].weight)
        torch.nn.init.zeros_(layer.ff[2].bias)
    diag = AttentionDiagnostics(probe_size=4)
    diag._probe = task.probe_batch(4)[0]
    outputs, attention = [], []
    hooks = [layer.register_forward_hook(lambda _, __, out: outputs.append(out[0])) for layer in module.encoder.layers]
    hooks += [
        layer.self_attn.register_forward_hook(lambda _, __, out: attention.append(out[0]))
        for layer in module.encoder.layers
    ]
    with torch.no_grad():
        module.eval()
        module.encoder(diag._probe)  # the fast path: the same numbers as the probe's eager path, to float rounding
    for hook in hooks:
        hook.remove()
    stats, _ = diag.compute(module)
    keep = diag._probe != task.pad_id
    for n in range(2):
        assert stats[f"attn/L{n}/rank_residual"] == pytest.approx(float(rank_residual(outputs[n], keep)), rel=1e-5)
        assert stats[f"attn/L{n}/rank_residual_attn"] == pytest.approx(
            float(rank_residual(attention[n], keep)), rel=1e-5
        )
    assert stats["attn/rank_residual"] == pytest.approx(
        (stats["attn/L0/rank_residual"] + stats["attn/L1/rank_residual"]) / 2
    )


def test_the_text_probe_draws_only_bytes_of_the_training_text():
    from helpers import small

    from attnlab.tasks.text import _split_bytes

    text = small("text", {"num_train": 16, "num_val": 16, "num_test": 16, "batch_size": 8}, seq_len=32)
    seen = set((_split_bytes("train") + 1).tolist())
    probe = text.repeated_probe(8)
    assert probe.shape == (8, 32) and set(probe.unique().tolist()) <= seen
    assert len(text.probe_vocabulary()) == len(seen) < 256


VARIANT_FILES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "variant").glob("*.yaml"))


@pytest.mark.parametrize("variant", [v for v in VARIANT_FILES if v != "custom"])
def test_every_variant_gets_every_head_diagnostic(hydra_ctx, variant):
    """Each conf/variant choice (softmax scores, presets, linear, decay and delta-rule forms) on a causal MQAR probe:
    the head-type scores, dilution and rank collapse are logged for every layer and head, in range; importance is a
    finite gradient for every head."""
    from helpers import compose_cfg

    from attnlab.callbacks import AttentionDiagnostics
    from attnlab.training.config import build_module, validate_config
    from attnlab.training.heads import prune_heads

    cfg = compose_cfg(
        "task=associative_recall", "mask=causal", f"variant={variant}", "d_model=16", "num_heads=2", "debug=fast"
    )
    task = validate_config(cfg)
    task.setup("fit")
    torch.manual_seed(0)
    module = build_module(cfg, task)
    diag = AttentionDiagnostics(probe_size=4)
    diag._probe, diag._repeated = task.probe_batch(4)[0], task.repeated_probe(4)
    stats, _ = diag.compute(module)
    for name in (*HEAD_SCORES, "near_mass"):
        values = [stats[f"attn/L{l}H{h}/{name}"] for l in range(2) for h in range(2)]
        assert all(0.0 <= v <= 1.0 for v in values), (name, values)
    assert all(0.0 <= stats[f"attn/L{l}/rank_residual"] <= 1.5 for l in range(2))
    assert all(math.isfinite(stats[f"attn/L{l}H{h}/locality"]) for l in range(2) for h in range(2))
    pruning, logged = prune_heads(module, task, seed=0, random_orders=0, val_batches=1, test_batches=1)
    assert all(math.isfinite(logged[f"attn/L{l}H{h}/importance"]) for l in range(2) for h in range(2))
    assert len(pruning["curves"]["importance"][0]) == 5 and "random" not in pruning["curves"]


# ---------------------------------------------------------------------------------------------- batched head step


def _gated_encoder():
    """A float64 encoder hiding padding keys: a differential-attention layer with GQA and a plain causal layer with
    multi-query attention, d_v ≠ d_k (so a gate spread over the wrong width shows), every parameter random; 5
    sequences (two padded) and random gates for each, zeros among them."""
    from attnlab.config import AttentionConfig

    attention = [
        AttentionConfig(differential=True, num_kv_heads=2, d_k=4, d_v=3),
        AttentionConfig(num_kv_heads=1, d_k=4, d_v=5, mask="causal"),
    ]
    enc = attnlab.Encoder(11, 12, 4, 2, pad_id=0, attention=attention).double().eval()
    randomize_(enc, 3, scale=0.4)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 11, (5, 7), generator=gen)
    tokens[1, 5:] = 0  # right padding
    tokens[3, 3:] = 0
    gates = torch.randn(5, 2, 4, generator=gen, dtype=torch.float64)
    gates[gates.abs() < 0.5] = 0.0  # about a third of the heads removed
    gates[0] = 1.0  # one sequence unpruned
    gates[2, 1] = 0.0  # one with a whole layer removed
    gates[4, 0, 2] = 0.0
    return enc, tokens, gates


def test_sequence_gates_give_each_sequence_the_output_of_its_own_head_gates(restore_process_state):
    from attnlab.heads import sequence_gates

    enc, tokens, gates = _gated_encoder()
    assert (gates == 0).any() and (gates == 1).all(dim=(1, 2)).any()
    layers = list(enc.layers)
    outer = [torch.full((4,), 0.5, dtype=torch.float64), torch.full((4,), 2.0, dtype=torch.float64)]
    with torch.no_grad(), head_gates(layers, outer):  # a gate set outside is put back, not applied inside
        with sequence_gates(layers, gates):
            assert all(layer.self_attn.head_gate is None for layer in layers)
            got = enc(tokens)
        assert all(layer.self_attn.head_gate is gate for layer, gate in zip(layers, outer, strict=True))
    with torch.no_grad():
        for n in range(tokens.shape[0]):
            with head_gates(layers, gates[n]):
                want = enc(tokens)[n]  # the same batch, every sequence with gates[n]: its row n
            torch.testing.assert_close(got[n], want, rtol=0, atol=0)
            ungated = enc(tokens[n : n + 1])
            with head_gates(layers, gates[n]):
                alone = enc(tokens[n : n + 1])[0]  # and, to rounding, that sequence alone under those gates
            torch.testing.assert_close(got[n], alone, rtol=1e-12, atol=1e-12)
            if bool((gates[n] != 1).any()):
                assert not torch.allclose(got[n], ungated[0])  # the gates did something
        # the hooks are gone: any batch size runs, ungated
        torch.testing.assert_close(enc(tokens[:2]), enc(tokens)[:2], rtol=1e-12, atol=1e-12)
    assert all(layer.self_attn.head_gate is None for layer in layers)
    assert all(not layer.self_attn.out_proj._forward_pre_hooks for layer in layers)


def test_sequence_gates_refuse_wrong_shapes_in_one_line_and_restore_the_layers(restore_process_state):
    from attnlab.heads import sequence_gates

    enc, tokens, gates = _gated_encoder()
    layers = list(enc.layers)
    bad = [
        (gates[0], r"gates must be \(N, 2, H\)"),  # (layers, H): not per sequence
        (gates[:, :1], r"gates must be \(N, 2, H\)"),  # one layer's gates for two layers
        (gates[:, :, :3], "4 heads got gates of shape"),
    ]
    for wrong, problem in bad:
        with pytest.raises(ValueError, match=problem) as info, sequence_gates(layers, wrong):
            pass
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="gates for 5 sequences, a batch of 3") as info, torch.no_grad():
        with sequence_gates(layers, gates):
            enc(tokens[:3])
    assert "\n" not in str(info.value)
    with pytest.raises(RuntimeError, match="inside"), sequence_gates(layers, gates):
        raise RuntimeError("inside")
    assert all(layer.self_attn.head_gate is None for layer in layers)
    assert all(not layer.self_attn.out_proj._forward_pre_hooks for layer in layers)
    with torch.no_grad():
        torch.testing.assert_close(enc(tokens[:3]), enc(tokens)[:3], rtol=1e-12, atol=1e-12)


PRUNE_CASES = [
    # task, dtype, report_bits, val_batches, test_batches, random_orders, batches per forward (None: the default)
    ("listops", torch.float64, False, None, None, 2, None),
    ("listops", torch.float32, False, None, None, 1, None),
    ("listops", torch.float64, False, 2, 2, 1, 2),
    ("associative_recall", torch.float64, True, 2, None, 1, 3),
]


@pytest.mark.parametrize(
    ("task_name", "dtype", "bits", "val_batches", "test_batches", "random_orders", "per_forward"),
    PRUNE_CASES,
    ids=[f"{c[0]}-{str(c[1])[6:]}-fit{c[-1]}" for c in PRUNE_CASES],
)
def test_prune_heads_equals_one_batch_and_one_gate_setting_at_a_time(
    monkeypatch, restore_process_state, task_name, dtype, bits, val_batches, test_batches, random_orders, per_forward
):
    """The batched head step against the plain loops: importance = mean over the validation batches of
    |∂L_b/∂ξ| (head_gates, one batch at a time), each curve point = evaluate() with its heads removed by
    head_gates. Listops (one class per sequence, right padding) and MQAR (per-token labels, -100 between); splits
    of 10 with batches of 4 (the last one of 2); the default budget (everything in one forward) and budgets of a
    few batches per forward (groups of settings, runs of batches, a short last group). In float64 the importance
    differs only by the float32 gates' gradient (and the float32 cross-entropy both take); in float32 by the
    summation order too."""
    from helpers import small

    from attnlab.config import AttentionConfig
    from attnlab.module import EncoderModule
    from attnlab.training import heads as step

    task = small(task_name, {"num_train": 8, "num_val": 10, "num_test": 10, "batch_size": 4})
    if per_forward is not None:
        length = task.tensors("test")[0].shape[1]
        monkeypatch.setattr(step, "TOKENS_PER_FORWARD", per_forward * task.batch_size * length)
    torch.manual_seed(0)
    attention = [AttentionConfig(differential=True, num_kv_heads=2), AttentionConfig(num_kv_heads=1)]
    module = EncoderModule(
        task.vocab_size, task.num_classes, task.per_token, task.pad_id, task.max_len,
        d_model=16, num_heads=4, attention=attention, report_bits=bits, dropout=0.2,
    ).to(dtype)  # fmt: skip
    randomize_(module, 1, scale=1.0)  # predictions that change as heads go
    module.train(per_forward is None)  # (dropout: the step must run in eval mode)
    calls = []
    pruning, logged = step.prune_heads(
        module, task, seed=5, random_orders=random_orders, val_batches=val_batches, test_batches=test_batches,
        progress=lambda done, total: calls.append((done, total)),
    )  # fmt: skip
    assert module.training == (per_forward is None)  # put back
    assert all(layer.self_attn.head_gate is None for layer in module.encoder.layers)
    module.eval()
    layers = list(module.encoder.layers)

    def split(name, limit):
        tokens, labels = task.tensors(name)
        out = [(tokens[i : i + 4], labels[i : i + 4]) for i in range(0, tokens.shape[0], 4)]
        return out if limit is None else out[:limit]

    val = split("val", val_batches)
    assert val[-1][0].shape[0] == 2 or val_batches is not None
    if test_batches is None:
        assert split("test", None)[-1][0].shape[0] == 2  # a short last test batch
    if task.per_token:
        assert (task.tensors("test")[1] == -100).any()
    else:
        assert (task.tensors("test")[0] == task.pad_id).any()

    want = torch.zeros(2, 4, dtype=torch.float64)
    for batch in val:
        gates = torch.ones(2, 4, dtype=dtype, requires_grad=True)
        with head_gates(layers, gates):
            (grad,) = torch.autograd.grad(module._loss(batch)[0], gates)
        want += grad.abs().double()
    want /= len(val)
    got = torch.tensor(pruning["importance"], dtype=torch.float64)
    rtol = 1e-6 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=rtol, atol=0)
    assert (want > 0).all()
    assert pruning["orders"]["importance"] == [[list(lh) for lh in importance_order(want)]]
    assert pruning["orders"].get("random", []) == [
        [list(lh) for lh in random_order(2, 4, 5 + r)] for r in range(random_orders)
    ]

    metric = "bpc" if bits else "acc"
    assert pruning["metric"] == metric and (pruning["num_layers"], pruning["num_heads"]) == (2, 4)
    accs, seen = set(), set()
    for name, orders in pruning["orders"].items():
        curves = pruning["curves"][name]
        assert len(curves) == len(orders)
        for order, curve in zip(orders, curves, strict=True):
            assert [p["removed"] for p in curve] == list(range(9))
            gates = torch.ones(2, 4, dtype=torch.float64)
            for k, point in enumerate(curve):
                if k:
                    gates[tuple(order[k - 1])] = 0.0
                with head_gates(layers, gates.clone()):
                    ref = step.evaluate(module, task, "test", limit=test_batches)
                assert set(point) == {"removed", *ref}, (name, k)
                assert point["acc"] == ref["acc"], (name, k, point, ref)
                assert point["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=0), (name, k)
                if bits:
                    assert point["bpc"] == pytest.approx(ref["loss"] / math.log(2), rel=1e-6), (name, k)
                accs.add(point["acc"])
                seen.add(tuple(gates.flatten().tolist()))
        mean = sum(sum(p[metric] for p in curve) / 9 for curve in curves) / len(curves)
        assert pruning["auc"][name] == pytest.approx(mean, rel=1e-12)
        assert logged[f"prune/auc_{name}"] == pruning["auc"][name]
    assert len(accs) > 1  # the accuracy moves as heads go: the comparison sees something
    assert calls and calls[-1] == (len(seen), len(seen)) and all(t == len(seen) for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    for layer in range(2):
        for head in range(4):
            assert logged[f"attn/L{layer}H{head}/importance"] == pytest.approx(float(want[layer, head]), rel=rtol)
