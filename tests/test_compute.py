"""Compute accounting (:mod:`attnlab.compute`) and budgets (``max_tokens``, ``match``).

* FLOPs of a training step against formulas written out here: a 2-layer scaled_dot encoder exactly (projections,
  attention forward and backward as the model's arithmetic: 2 products forward, 4 backward, the FFN, the head;
  backward = the gradients of inputs and weights), the fused kernels' formulas, and for every score, normalizer and
  backend an attention part > 0 beside the linear layers' FLOPs (counted by hand).
* One convention for every backend: one layer of scaled_dot (SDPA), t5_bias and relative_position (the relative
  kernel, biased_softmax, SDPA's math kernel, eager), ALiBi and grouped-query attention against a hand count; a
  position bias never lowers the count; ``auto`` and every backend that computes a layer give the same FLOPs; torch's
  SDPA formulas (CPU and CUDA kernels) replaced, grouped heads counted per query head.
* ``params_non_embedding`` by hand; :func:`~attnlab.compute.closest_width` and ``match`` by hand; ``max_tokens``.
* One real tiny run whose summary.json holds every new field, its results table the FLOPs column.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import RECURRENT_FORMS, SCORES, params_of, train_listops
from hydra import compose, initialize_config_dir
from rich.console import Console
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import attnlab
from attnlab import compute
from attnlab.compute import Unreachable, closest_width, count_flops, non_embedding_params, step_flops
from attnlab.config import AttentionConfig
from attnlab.kernels import additive, relative
from attnlab.module import EncoderModule
from attnlab.runs import SCHEMA_VERSION, Summary
from attnlab.training.config import CONF_DIR, ConfigError, build_module, resolve_match, validate_config
from attnlab.training.console import compact, results_table

pytestmark = pytest.mark.usefixtures("single_thread")


def lin(rows: int, n_in: int, n_out: int) -> int:
    """The forward FLOPs of a linear layer on ``rows`` rows: 2 per multiply-add."""
    return 2 * rows * n_in * n_out


def linear_step_flops(module: EncoderModule, batch: int, length: int) -> int:
    """Forward + backward FLOPs of every nn.Linear of ``module`` on a (batch, length) step, by hand: each takes
    B·L rows (the head of a per-sequence task: B), and its backward is the gradients of its input and its weight,
    twice its forward."""
    total = 0
    for name, layer in module.named_modules():
        if isinstance(layer, nn.Linear):
            rows = batch if name == "head" and not module.per_token else batch * length
            total += 3 * lin(rows, layer.in_features, layer.out_features)
    return total


def encoder(attention: AttentionConfig | None = None, *, layers: int = 1, per_token: bool = True, **sizes):
    sizes = {"d_model": 8, "num_heads": 2, "max_len": 6, "vocab_size": 7, "num_classes": 3, **sizes}
    return EncoderModule(
        per_token=per_token, pad_id=None, num_layers=layers, attention=attention or AttentionConfig(), **sizes
    )


@contextlib.contextmanager
def hydra() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


SMALL = ["task=digits", "d_model=16", "num_heads=2", "num_layers=2", "logger=none", "diagnostics.enabled=false"]


# ---------------------------------------------------------------------------------------------- one training run


def test_a_trained_run_records_its_compute_and_its_budgets(tmp_path: Path, restore_process_state: None) -> None:
    """One real run (ListOps, debug=fast) with a token budget and a parameter target: summary.json has every field
    of schema 5 with its value, and the results table the FLOPs per token."""
    fixed = ["task=listops", "debug=fast", "logger=none", "results_table=false", "d_model=16", "num_heads=2"]
    with hydra():
        probe = compose("config", overrides=fixed)
        dm = validate_config(probe)
        base = build_module(probe, dm).num_parameters
    per_step = dm.batch_size * dm.seq_len
    budget = 6 * per_step + 1  # 7 steps, rounded up to eval_every (5): 10
    summary = train_listops(tmp_path, f"max_tokens={budget}", "match.by=params", f"match.target={base + 500}")
    assert summary["status"] == "ok", summary["reason"]
    assert summary["schema_version"] == SCHEMA_VERSION == 5
    assert summary["max_tokens"] == budget and summary["max_steps"] == summary["steps"] == 10
    assert summary["tokens_per_step"] == per_step
    assert summary["tokens_seen"] == 10 * dm.batch_size * dm.seq_len
    assert 0 < summary["step_time_s"] < summary["wall_time_s"]
    matched = summary["matched"]
    assert matched["by"] == "params" and matched["width"] == "model.d_ff" and matched["target"] == base + 500
    assert matched["achieved"] == summary["params"] and abs(matched["achieved"] - (base + 500)) <= 2 * 16 + 1
    # the embedding: vocab_size × d_model (ListOps has sinusoidal positions, no table)
    assert summary["params"] - summary["params_non_embedding"] == dm.vocab_size * 16
    with hydra():  # the run's FLOPs are those of its model's step
        cfg = compose("config", overrides=[*fixed, f"model.d_ff={matched['value']}"])
        module = build_module(cfg, validate_config(cfg))
    assert summary["flops_per_token"] == step_flops(module, dm.batch_size, dm.seq_len) / per_step
    out = io.StringIO()
    Console(file=out, width=200).print(results_table(Summary.from_dict(summary)))
    header, row = (line for line in out.getvalue().splitlines() if "│" in line or "┃" in line)
    assert "FLOPs/tok" in header and f" {compact(summary['flops_per_token'])} " in row


def test_an_older_summary_reads_with_the_new_fields_null() -> None:
    summary = Summary.from_dict({"schema_version": 4, "status": "ok", "params": 10, "state_size": [3]})
    assert summary.schema_version == SCHEMA_VERSION and summary.params == 10
    for name in ("params_non_embedding", "flops_per_token", "tokens_per_step", "tokens_seen", "step_time_s"):
        assert getattr(summary, name) is None
    assert summary.max_tokens is None and summary.matched is None


# ---------------------------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_scaled_dot_encoder_step_is_the_hand_formula(seed: int, per_token: bool) -> None:
    r = random.Random(seed)
    B, L, d, H, d_k = r.randint(1, 4), r.randint(3, 17), r.randint(5, 24), r.randint(1, 3), r.randint(2, 9)
    d_ff, V, C = r.randint(3, 40), r.randint(5, 30), r.randint(2, 9)
    module = encoder(
        layers=2,
        per_token=per_token,
        d_model=d,
        num_heads=H,
        d_k=d_k,
        d_ff=d_ff,
        max_len=L,
        vocab_size=V,
        num_classes=C,
    ).double()
    rows = B * L
    forward = {
        "q, k, v": 3 * lin(rows, d, H * d_k),
        "attention": 2 * 2 * B * H * L * L * d_k,  # q·kᵀ, P·v
        "out": lin(rows, H * d_k, d),
        "ffn": lin(rows, d, d_ff) + lin(rows, d_ff, d),
    }
    backward = {
        "linear": 2 * (forward["q, k, v"] + forward["out"] + forward["ffn"]),  # input and weight gradients
        # the model's backward, without the scores a fused kernel recomputes: dP = dO·vᵀ, dv = Pᵀ·dO, dq = dS·k,
        # dk = dSᵀ·q
        "attention": 4 * 2 * B * H * L * L * d_k,
    }
    head = 3 * lin(rows if per_token else B, d, C)
    expected = 2 * (sum(forward.values()) + sum(backward.values())) + head
    assert step_flops(module, B, L) == expected
    assert linear_step_flops(module, B, L) == expected - 2 * (forward["attention"] + backward["attention"])


def test_counting_leaves_the_model_and_the_random_numbers_alone() -> None:
    module = encoder(layers=2).eval()
    before = copy.deepcopy(module.state_dict())
    state = torch.get_rng_state()
    assert step_flops(module, 2, 6) > 0
    assert torch.equal(torch.get_rng_state(), state)
    assert not module.training and all(p.grad is None for p in module.parameters())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def attention_flops(config: AttentionConfig, batch: int = 2, length: int = 6) -> tuple[int, int]:
    """(the step's FLOPs, its linear layers' FLOPs by hand) of a one-layer encoder with ``config``."""
    module = encoder(config, max_len=length)
    return step_flops(module, batch, length), linear_step_flops(module, batch, length)


CAUSAL_SOFTMAX_FORMS = [  # softmax forms that are causal only (issue 45: forgetting, mta), from the registry
    n for n in attnlab.forms.form_names_with("softmax") if attnlab.forms.form_class(n).causal_only
]


def config_of(name: str) -> AttentionConfig:
    recurrent = {"mask": "causal", "normalizer": "none"} if name in RECURRENT_FORMS else {}
    if name in CAUSAL_SOFTMAX_FORMS:
        recurrent = {"mask": "causal"}
    return AttentionConfig(score=name, score_params=params_of("score", name), **recurrent)


@pytest.mark.parametrize("name", [*SCORES, *RECURRENT_FORMS, *CAUSAL_SOFTMAX_FORMS])
def test_every_score_counts_its_attention(name: str) -> None:
    total, linear = attention_flops(config_of(name))
    assert total > linear, f"{name}: no FLOPs beside the linear layers"


RECURRENT_SETTINGS = {s.label: s for s in attnlab.forms.form_settings("recurrent")}


def setting_config(setting: attnlab.forms.FormSetting) -> AttentionConfig:
    """A causal layer of a recurrent form at one of its settings (its test parameters, then the setting's)."""
    params = {**params_of("score", setting.form), **setting.params}
    normalizer = "rowsum" if "linear" in attnlab.forms.form_class(setting.form).tags else "none"
    return AttentionConfig(score=setting.form, score_params=params, normalizer=normalizer, mask="causal")


def lower_channels_flops(x_shape: tuple[int, ...], d: int) -> int:
    """The forward FLOPs of attnlab.transition._lower_channels on x (…, n, d), by hand (CHANNEL_LEAF = 1): n padded
    to size = 2^m; the diagonal, each entry Σ_c x_ic y_ic (a product: 2·d); the first halving level, 1 × 1 blocks
    (elementwise, free); each level s = 2, 4, …, size/2: size/(2s) matrix products (s × d)(d × s), size·s·d FLOPs."""
    n, rows = x_shape[-2], math.prod(x_shape[:-2])
    size = 1 << max(n - 1, 0).bit_length()
    levels = sum(size * s * d for s in (2**i for i in range(1, size.bit_length() - 1)))
    return rows * (2 * size * d + levels)


def test_the_per_channel_lower_matrix_counts_its_halving_products() -> None:
    """GLA's and KDA's per-channel P and G (attnlab.transition._lower_channels: blocks on the diagonal, every other
    block a matrix product of factors in [0, 1] by halving) are matrix products under the counter: forward by hand,
    backward twice that (the gradients of both factors); with x stacking P's and G's left factors, both counted."""
    from attnlab import transition

    assert transition.CHANNEL_LEAF == 1, "the hand count below is for diagonal blocks of 1"
    gen = torch.Generator().manual_seed(0)
    for lead, n, d in (((2, 3), 8, 4), ((2, 2, 3), 6, 4), ((1, 2), 64, 8), ((1, 1), 1, 3)):
        x, y = (torch.randn(*lead, n, d, generator=gen, requires_grad=True) for _ in range(2))
        b = (-torch.rand(*lead, n, d, generator=gen)).cumsum(-2)
        forward = count_flops(lambda x=x, y=y, b=b: transition._lower_channels(x, y, b))
        assert forward == lower_channels_flops(x.shape, d) > 0, (lead, n, d)
        step = count_flops(lambda x=x, y=y, b=b: transition._lower_channels(x, y, b).sum().backward())
        assert step == 3 * forward, (lead, n, d)
    assert lower_channels_flops((2, 3, 8, 4), 4) == 6 * 8 * 8 * 4  # rows · size² · d


@pytest.mark.parametrize("label", list(RECURRENT_SETTINGS))
def test_every_recurrent_setting_counts_its_attention_and_the_per_channel_products(
    label: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every FormSetting of form_settings("recurrent") (gla_channel, gla_mamba2, the β ∈ (0, 2) settings, kda …):
    a training step counts FLOPs in attention beyond the linear layers (projections and gates). A per-channel decay
    (GLA's channel gate, KDA's) computes P (and G) by halving (transition._lower_channels): the step counts exactly
    those matrix products, forward and backward (the step's count less the same step with a product-free
    _lower_channels)."""
    from attnlab import transition

    setting = RECURRENT_SETTINGS[label]
    config = setting_config(setting)
    module = encoder(config, max_len=6)
    total, linear = step_flops(module, 2, 6), linear_step_flops(module, 2, 6)
    assert total > linear, f"{label}: no FLOPs beside the linear layers"

    calls: list[tuple[tuple[int, ...], int]] = []
    original = transition._lower_channels

    def recorded(x, y, b, diagonal=0):
        calls.append((tuple(x.shape), x.shape[-1]))
        return original(x, y, b, diagonal)

    def product_free(x, y, b, diagonal=0):  # the same values, elementwise: free under the counter
        return (x.unsqueeze(-2) * transition._channel_decay_matrix(b, diagonal) * y.unsqueeze(-3)).sum(-1)

    monkeypatch.setattr(transition, "_lower_channels", recorded)
    assert step_flops(module, 2, 6) == total
    if getattr(module.encoder.layers[0].self_attn.form, "per_channel", False):
        assert calls, f"{label}: a per-channel decay that never took the halving form"
    if not calls:
        return
    monkeypatch.setattr(transition, "_lower_channels", product_free)
    halving = sum(3 * lower_channels_flops(shape, d) for shape, d in calls)
    assert total - step_flops(module, 2, 6) == halving > 0, label


@pytest.mark.parametrize("name", attnlab.list_normalizers())
def test_every_normalizer_counts_its_attention(name: str) -> None:
    causal = getattr(attnlab.normalizers._NORMALIZERS.get(name), "causal_only", False)  # stick-breaking
    total, linear = attention_flops(AttentionConfig(normalizer=name, mask="causal" if causal else None))
    assert total > linear, f"normalizer={name}: no FLOPs beside the linear layers"


BACKEND_CANDIDATES = [
    AttentionConfig(),
    AttentionConfig(position_bias="t5"),
    AttentionConfig(position_bias="shaw", position_bias_params={"clip": 2}),
    AttentionConfig(score="linear", normalizer="rowsum"),
    AttentionConfig(score="linear", normalizer="rowsum", mask="causal"),
    AttentionConfig(score="retnet", normalizer="none", mask="causal"),
    AttentionConfig(softcap=5.0),  # normalized
]


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name == "flex" and not torch.cuda.is_available(),
                reason="CPU FlexAttention is forward-only: a training step needs CUDA",
            ),
        )
        for name in attnlab.list_backends()
    ],
)
def test_every_backend_counts_its_attention(backend: str) -> None:
    """Each backend, forced on the first configuration it computes (of a list that covers the built-in ones)."""
    for candidate in BACKEND_CANDIDATES:
        config = candidate.replace(backend=backend)
        try:
            module = encoder(config)
        except ValueError:
            continue
        assert module.encoder.layers[0].self_attn.backend_for() == backend
        total, linear = step_flops(module, 2, 6), linear_step_flops(module, 2, 6)
        assert total > linear, f"backend={backend}: no FLOPs beside the linear layers"
        return
    pytest.fail(f"backend {backend} computes none of the candidate configurations: add one it computes")


@pytest.mark.skipif(not additive.available(), reason=f"no additive kernel: {additive.unavailable_reason()}")
def test_the_additive_kernel_counts_the_contraction_it_replaces() -> None:
    B, H, Lq, Lk, A = 2, 3, 5, 7, 4
    wq, uk, v = (
        torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((B, H, Lq, A), (B, H, Lk, A), (H, A))
    )
    forward = 2 * B * H * Lq * Lk * A  # Σ_a v_a tanh(wq_ia + uk_ja) for each (b, h, i, j)
    assert count_flops(lambda: additive.additive_logits(wq, uk, v)) == forward
    assert count_flops(lambda: additive.additive_logits(wq, uk, v).sum().backward()) == forward + 3 * forward
    assert wq.grad is not None and uk.grad is not None and v.grad is not None


@pytest.mark.skipif(not relative.available(), reason=f"no relative kernel: {relative.unavailable_reason()}")
@pytest.mark.parametrize("per_row", [True, False])
def test_the_relative_kernel_counts_its_products_once_on_either_path(per_row: bool) -> None:
    B, H, Lq, Lk, d, d_v, clip = 2, 2, 5, 6, 3, 4, 2
    q, k = torch.randn(B, H, Lq, d, dtype=torch.float64), torch.randn(B, H, Lk, d, dtype=torch.float64)
    v = torch.randn(B, H, Lk, d_v, dtype=torch.float64)
    index = (torch.arange(Lk)[None, :] - torch.arange(Lq)[:, None]).clamp(-clip, clip) + clip
    table = torch.randn(*((B, H, Lq) if per_row else (H,)), 2 * clip + 1, dtype=torch.float64)
    runs = relative.Runs(index)
    forward = 2 * B * H * Lq * Lk * d + 2 * B * H * Lq * Lk * d_v  # q·kᵀ, P·v
    backward = 2 * forward  # dv = Pᵀ·dz, dP = dz·vᵀ, dq = dS·k, dk = dSᵀ·q

    def step(fn):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, table)]
        return lambda: fn(*inputs).sum().backward()

    def impl(*t):  # the autograd function itself: the products inside it are torch's, seen one by one
        return relative._RelativeFunction.apply(*t, runs.ptr, runs.starts, runs.cols, None, 0.5, per_row)

    assert count_flops(step(lambda *t: relative.relative_attention(*t, runs, None, 0.5))) == forward + backward
    assert count_flops(step(impl)) == forward + backward


# ---------------------------------------------------------------------------------------------- one convention


def attention_hand_count(B: int, Hq: int, Lq: int, Lk: int, d_k: int, d_v: int) -> int:
    """One attention layer's products in a training step, the model's arithmetic: q·kᵀ and P·v forward, per query
    head (grouped heads too), then dv = Pᵀ·dO, dP = dO·vᵀ, dq = dS·k, dk = dSᵀ·q backward (twice the forward),
    whatever a fused kernel recomputes."""
    forward = 2 * B * Hq * Lq * Lk * d_k + 2 * B * Hq * Lq * Lk * d_v
    return forward + 2 * forward


def counted_step(module: EncoderModule, batch: int, length: int, seed: int = 0) -> dict[str, int]:
    """FLOPs of one training step of ``module`` per operator (fresh random tokens and labels)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, module.hparams["vocab_size"], (batch, length), generator=gen)
    labels = torch.randint(0, module.hparams["num_classes"], (batch, length), generator=gen)
    module.train().zero_grad()
    with FlopCounterMode(display=False) as counter:
        module._loss((tokens, labels))[0].backward()
    return {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}


T5 = {"num_buckets": 8, "max_distance": 16}
CLIP = 2
HAND_CASES = [
    # (id, attention config, the backend to force (auto: the one expected), the operator that must have counted)
    ("scaled_dot-sdpa", AttentionConfig(), "sdpa", "aten._scaled_dot_product_flash_attention_for_cpu"),
    ("scaled_dot-eager", AttentionConfig(backend="eager"), "eager", "aten.bmm"),
    ("t5_bias-tiled", AttentionConfig(score="t5_bias", score_params=T5), "tiled", "attnlab.tiled_attention"),
    (
        "t5_bias-relative",
        AttentionConfig(score="t5_bias", score_params=T5, backend="relative"),
        "",
        "attnlab.relative_attention",
    ),
    ("t5_bias-biased_softmax", AttentionConfig(score="t5_bias", score_params=T5, backend="biased_softmax"), "", ""),
    ("t5_bias-sdpa", AttentionConfig(score="t5_bias", score_params=T5, backend="sdpa"), "", ""),
    ("t5_bias-eager", AttentionConfig(score="t5_bias", score_params=T5, backend="eager"), "", "aten.bmm"),
    (
        "relative_position-tiled",
        AttentionConfig(score="relative_position", score_params={"clip": CLIP}),
        "tiled",
        "attnlab.tiled_attention",
    ),
    (
        "relative_position-relative",
        AttentionConfig(score="relative_position", score_params={"clip": CLIP}, backend="relative"),
        "",
        "attnlab.relative_attention",
    ),
    (
        "relative_position-sdpa",
        AttentionConfig(score="relative_position", score_params={"clip": CLIP}, backend="sdpa"),
        "",
        "",
    ),
    (
        "relative_position-eager",
        AttentionConfig(score="relative_position", score_params={"clip": CLIP}, backend="eager"),
        "",
        "aten.bmm",
    ),
    ("alibi-tiled", AttentionConfig(position_bias="alibi"), "tiled", "attnlab.tiled_attention"),
    ("alibi-sdpa", AttentionConfig(position_bias="alibi", backend="sdpa"), "", ""),
    ("alibi-eager", AttentionConfig(position_bias="alibi", backend="eager"), "", ""),
    ("gqa1-sdpa", AttentionConfig(num_kv_heads=1), "sdpa", "aten._scaled_dot_product_flash_attention_for_cpu"),
    (
        "gqa2-sdpa",
        AttentionConfig(num_kv_heads=2, mask="causal"),
        "sdpa",
        "aten._scaled_dot_product_flash_attention_for_cpu",
    ),
    ("gqa1-eager", AttentionConfig(num_kv_heads=1, backend="eager"), "", ""),
    ("gqa1-t5-tiled", AttentionConfig(num_kv_heads=1, position_bias="t5", position_bias_params=T5), "tiled", ""),
    (
        "gqa1-t5-relative",
        AttentionConfig(num_kv_heads=1, position_bias="t5", position_bias_params=T5, backend="relative"),
        "",
        "",
    ),
]


@pytest.mark.parametrize(("config", "backend", "operator"), [c[1:] for c in HAND_CASES], ids=[c[0] for c in HAND_CASES])
@pytest.mark.parametrize("seed", [1, 2])
def test_one_layer_is_the_hand_count_on_every_backend(
    config: AttentionConfig, backend: str, operator: str, seed: int
) -> None:
    """Projections (counted by hand from the layers' sizes) + the attention's 2 products forward and 4 backward,
    per query head, + Shaw's table q·w^Kᵀ (B, H, L, 2·clip + 1) and its two gradients: whichever backend computes
    it, fused (SDPA's flash kernel recomputes q·kᵀ, the relative kernel does not) or eager (autograd's)."""
    r = random.Random(seed)
    B, L, H, d_k = r.randint(1, 3), r.randint(4, 11), 4, r.randint(2, 5)
    module = encoder(config, d_model=r.randint(6, 12), num_heads=H, d_k=d_k, max_len=L, d_ff=r.randint(3, 9))
    attn = module.encoder.layers[0].self_attn
    if backend:
        assert attn.backend_for() == backend
    ops = counted_step(module, B, L, seed)
    if operator:
        assert ops.get(operator, 0) > 0, ops
    shaw = 3 * 2 * B * H * L * d_k * (2 * CLIP + 1) if config.score == "relative_position" else 0
    expected = linear_step_flops(module, B, L) + attention_hand_count(B, H, L, L, d_k, d_k) + shaw
    assert sum(ops.values()) == expected, ops
    assert step_flops(module, B, L) == expected


def bias_cases() -> list[tuple[str, AttentionConfig]]:
    """Every built-in position bias, and every score that brings one (t5_bias, relative_position, alibi)."""
    cases = [
        (f"position_bias={n}", AttentionConfig(position_bias=n, position_bias_params=params_of("position_bias", n)))
        for n in attnlab.list_position_biases()
        if n != "none"
    ]
    for name in SCORES:
        config = AttentionConfig(score=name, score_params=params_of("score", name))
        attn = attnlab.MultiHeadAttention(8, 2, config=config)
        if attn.position_bias is not None or getattr(attn.score, "position_term", lambda: None)() is not None:
            cases.append((f"score={name}", config))
    return cases


@pytest.mark.parametrize(
    ("config", "backend"),
    [(c, b) for _, c in bias_cases() for b in ("auto", "eager")],
    ids=[f"{i}-{b}" for i, _ in bias_cases() for b in ("auto", "eager")],
)
def test_adding_a_bias_never_lowers_the_count(config: AttentionConfig, backend: str) -> None:
    """The biased layer's step ≥ the plain scaled_dot step at the same shapes (both as ``auto`` chooses, or both
    eager): a bias adds work (a table's products) or none (a static bias: elementwise, free), never less."""
    B, L, H, d_k = 2, 9, 2, 4
    sizes = {"d_model": 8, "num_heads": H, "d_k": d_k, "max_len": L}
    biased = sum(counted_step(encoder(config.replace(backend=backend), **sizes), B, L).values())
    plain = sum(counted_step(encoder(AttentionConfig(backend=backend), **sizes), B, L).values())
    assert biased >= plain
    assert plain == linear_step_flops(encoder(**sizes), B, L) + attention_hand_count(B, H, L, L, d_k, d_k)


SAME_COUNT = [
    ("plain", AttentionConfig()),
    ("t5", AttentionConfig(position_bias="t5", position_bias_params=T5)),
    ("shaw", AttentionConfig(position_bias="shaw", position_bias_params={"clip": CLIP})),
    ("alibi-causal", AttentionConfig(position_bias="alibi", mask="causal")),
    ("gqa", AttentionConfig(num_kv_heads=1)),
    ("gqa-t5", AttentionConfig(num_kv_heads=2, position_bias="t5", position_bias_params=T5)),
    ("softcap", AttentionConfig(softcap=5.0)),
    ("sparsemax", AttentionConfig(normalizer="sparsemax")),
    ("window", AttentionConfig(mask={"name": "sliding_window", "window": 2})),
    # known: SDPA runs a sink logit as one more key and dimension, differential attention as two P·v (eager: one,
    # on the combined weights): products beyond the model's that a FLOP formula cannot tell apart
    pytest.param("softmax1", AttentionConfig(normalizer="softmax1"), marks=pytest.mark.xfail(strict=True)),
    pytest.param("differential", AttentionConfig(differential=True), marks=pytest.mark.xfail(strict=True)),
]


@pytest.mark.parametrize(("name", "config"), SAME_COUNT)
def test_every_backend_counts_the_same_attention(name: str, config: AttentionConfig) -> None:
    """The same layer, ``auto`` and forced onto every backend that computes it in a CPU training step: the same
    FLOPs as eager, whose softmax is free and whose autograd runs 2 products forward and 4 backward."""
    B, L, H, d_k = 2, 8, 4, 3
    sizes = {"d_model": 12, "num_heads": H, "d_k": d_k, "max_len": L}
    counts = {}
    for backend in ["auto", *attnlab.list_backends()]:
        try:
            module = encoder(config.replace(backend=backend), **sizes)
            module.encoder.layers[0].self_attn.backend_for()
        except (ValueError, RuntimeError):  # a backend that does not compute this layer (here)
            continue
        counts[backend] = sum(counted_step(module, B, L).values())
    assert {"auto", "eager"} <= set(counts) and len(counts) >= 3, counts  # auto, eager and one fused backend
    assert set(counts.values()) == {counts["eager"]}, counts
    if name in ("plain", "t5", "alibi-causal", "window", "softcap", "sparsemax"):
        linear = linear_step_flops(encoder(config.replace(backend="eager"), **sizes), B, L)
        assert counts["eager"] == linear + attention_hand_count(B, H, L, L, d_k, d_k)


def test_the_tiled_differential_operator_counts_each_maps_products_and_the_shared_ones_once() -> None:
    """Differential attention in the tiled kernel (2H maps of d_k, H heads of d_v): forward each map's q·kᵀ and
    P·v; backward dv and dP once on the combined weights (as eager's autograd) and dq, dk per map."""
    B, L, H, d_k = 2, 8, 4, 3
    sizes = {"d_model": 12, "num_heads": H, "d_k": d_k, "max_len": L}
    config = AttentionConfig(differential=True, backend="tiled", position_bias="t5", position_bias_params=T5)
    module = encoder(config, **sizes)
    u = 2 * B * H * L * L  # one (B, H, L, L) product per unit of inner size
    attention = 2 * u * (d_k + d_k) + u * (2 * d_k + 4 * d_k)
    counted = counted_step(module, B, L)
    assert counted["attnlab.tiled_differential"] == 2 * u * (d_k + d_k), counted
    assert sum(counted.values()) == linear_step_flops(module, B, L) + attention


@pytest.mark.parametrize("op", [*compute.SDPA_FORWARD, *compute.SDPA_BACKWARD], ids=str)
@pytest.mark.parametrize(("Hq", "G"), [(6, 6), (6, 2), (6, 1)])
def test_torchs_sdpa_formulas_are_replaced_and_count_grouped_heads(op, Hq: int, G: int) -> None:
    """Every SDPA kernel's formula, the CUDA ones that torch registers itself included, is this module's: the
    model's products per query head (torch 2.11's asserted Hq == Hk on an H100 for grouped heads; its backward counts
    the recomputed scores)."""
    B, Lq, Lk, d, d_v = 2, 5, 7, 3, 4
    q, k, v = (torch.empty(s, device="meta") for s in ((B, Hq, Lq, d), (B, G, Lk, d), (B, G, Lk, d_v)))
    formula = flop_registry[op]
    backward = op in compute.SDPA_BACKWARD
    assert formula is (compute._sdpa_backward_flops if backward else compute._sdpa_flops)  # (not torch's)
    forward = 2 * B * Hq * Lq * Lk * d + 2 * B * Hq * Lq * Lk * d_v
    if backward:
        assert formula(torch.empty(B, Hq, Lq, d_v, device="meta"), q, k, v) == 2 * forward
    else:
        assert formula(q, k, v) == forward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's SDPA kernels need a GPU")
@pytest.mark.parametrize("kernel", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_cuda_sdpa_kernels_count_the_models_products_with_grouped_heads(kernel: str) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, Hq, G, L, d = 2, 8, 2, 128, 64
    q = torch.randn(B, Hq, L, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, G, L, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def step() -> None:
        with sdpa_kernel(getattr(SDPBackend, kernel)):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True).float().sum().backward()

    try:
        total = count_flops(step)
    except RuntimeError as error:  # a kernel this GPU / torch does not offer for these inputs
        pytest.skip(f"{kernel}: {str(error).splitlines()[0]}")
    assert total == attention_hand_count(B, Hq, L, L, d, d)


# ---------------------------------------------------------------------------------------------- parameters


def test_params_non_embedding_leaves_out_the_token_embedding_and_a_learned_position_table() -> None:
    d, V, L, C, H = 12, 9, 10, 4, 3
    sinusoidal = encoder(d_model=d, vocab_size=V, max_len=L, num_classes=C, num_heads=H, layers=2)
    assert non_embedding_params(sinusoidal) == sinusoidal.num_parameters - V * d
    learned = encoder(d_model=d, vocab_size=V, max_len=L, num_classes=C, num_heads=H, pos_encoding="learned")
    assert non_embedding_params(learned) == learned.num_parameters - V * d - L * d
    # a relative-position table is the attention's: counted (Shaw's a^K: 2·clip + 1 rows of d_k)
    shaw = AttentionConfig(position_bias="shaw", position_bias_params={"clip": 3, "value_term": False})
    biased = encoder(shaw, d_model=d, vocab_size=V, max_len=L, num_classes=C, num_heads=H)
    plain = encoder(d_model=d, vocab_size=V, max_len=L, num_classes=C, num_heads=H)
    assert non_embedding_params(biased) - non_embedding_params(plain) == 7 * (d // H)
    # by hand: per layer q, k, v, out (+ biases), two norms, the FFN (d_ff = 4d); the final norm, the head
    layer = 4 * (d * d + d) + 2 * 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert non_embedding_params(plain) == layer + 2 * d + d * C + C


# ---------------------------------------------------------------------------------------------- budgets


def test_closest_width_bisects_to_the_nearest_count() -> None:
    calls = []

    def count(width: int) -> int:
        calls.append(width)
        return 3 * width + 10

    assert closest_width(count, 100) == (30, 100)
    assert closest_width(count, 101) == (30, 100)  # 103 is further
    assert closest_width(count, 102) == (31, 103)
    assert closest_width(count, 13) == (1, 13)
    assert len(calls) < 60
    with pytest.raises(Unreachable, match="smallest width"):
        closest_width(count, 12)
    with pytest.raises(Unreachable, match="does not change with the width"):
        closest_width(lambda width: 5, 6, high=64)


def sd_params(d: int, H: int, d_k: int, d_ff: int, layers: int, V: int, C: int) -> int:
    """A scaled_dot encoder's parameters by hand (sinusoidal positions, pre-LN)."""
    per_layer = 3 * (d * H * d_k + H * d_k) + (H * d_k * d + d) + 2 * 2 * d + (d * d_ff + d_ff) + (d_ff * d + d)
    return V * d + layers * per_layer + 2 * d + d * C + C


def matched(*overrides: str):
    """The config of ``overrides`` (on SMALL), checked and matched: (cfg, its datamodule, what match found)."""
    with hydra():
        cfg = compose("config", overrides=[*SMALL, *overrides])
        dm = validate_config(cfg)
        found = resolve_match(cfg, dm)
    return cfg, dm, found


@pytest.mark.parametrize("extra", [3, 40])
def test_match_params_finds_the_d_ff_of_the_nearest_count(extra: int) -> None:
    with hydra():
        dm = validate_config(compose("config", overrides=SMALL))
    V, C = dm.vocab_size, dm.num_classes
    target = sd_params(16, 2, 8, 37, 2, V, C) + extra  # d_ff 38 has 2·(2·16 + 1) = 66 more
    cfg, _, found = matched("match.by=params", f"match.target={target}")
    width = 37 if extra < 33 else 38
    assert cfg.model.d_ff == found["value"] == width
    assert found == {
        "by": "params",
        "width": "model.d_ff",
        "value": width,
        "target": target,
        "achieved": sd_params(16, 2, 8, width, 2, V, C),
        "reference": None,
    }


def test_match_a_reference_variant_by_hand() -> None:
    """variant=additive sized to scaled_dot's parameters (d_ff 4·16): additive adds w_q, w_k (H, d_k, d_a) and v
    (H, d_a) per layer, d_a = d_k, which fewer FFN units make up for."""
    cfg, dm, found = matched("variant=additive", "match.by=params", "match.reference=scaled_dot")
    V, C = dm.vocab_size, dm.num_classes
    target = sd_params(16, 2, 8, 64, 2, V, C)
    extra = 2 * (2 * 2 * 8 * 8 + 2 * 8)
    best = min(range(1, 65), key=lambda w: (abs(sd_params(16, 2, 8, w, 2, V, C) + extra - target), w))
    assert found["target"] == target and found["reference"] == "scaled_dot"
    assert cfg.model.d_ff == found["value"] == best == 56
    assert found["achieved"] == sd_params(16, 2, 8, best, 2, V, C) + extra


def test_match_state_size_by_d_k() -> None:
    """Linear attention's state per layer is H·(d_k·d_k + d_k) (elu features: d_φ = d_k, with the row sums)."""
    cfg, _, found = matched("variant=linear", "match.by=state_size", "match.width=d_k", f"match.target={4 * 110 + 1}")
    assert cfg.d_k == found["value"] == 10 and found["achieved"] == 2 * 2 * (10 * 10 + 10)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["match.by=params", "match.width=model.dff", "match.target=5"],
            "not a key of the config; did you mean model.d_ff",
        ),
        (["match.by=params", "match.width=lr", "match.target=5"], "lr is 0.003, not an integer"),
        (["match.by=params", "match.target=5"], "no model.d_ff reaches 5 params: the smallest width"),
        (["match.by=params", "match.width=seed", "match.target=10000000"], "does not change with the width"),
        (["match.by=params"], "set match.target=<count> or match.reference=<variant>"),
        (["match.by=params", "match.target=5", "match.reference=dot"], "not both"),
        (["match.by=flops", "match.target=5"], "match.by must be one of params, state_size"),
        (["match.target=5"], "match.target is set but match.by is null"),
        (["match.by=params", "match.reference=addtive"], "did you mean 'additive'"),
    ],
)
def test_a_bad_match_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        matched(*overrides)
    assert "\n" not in str(info.value)


def test_max_tokens_sets_max_steps() -> None:
    with hydra():
        cfg = compose("config", overrides=[*SMALL, "max_tokens=2e5", "eval_every=10"])
        dm = validate_config(cfg)
    steps = math.ceil(200_000 / (dm.batch_size * dm.seq_len))
    assert cfg.max_tokens == 200_000 and type(cfg.max_tokens) is int
    assert cfg.max_steps == cfg.trainer.max_steps == 10 * math.ceil(steps / 10)
    with hydra(), pytest.raises(ConfigError, match="max_tokens must be an integer >= 1"):
        validate_config(compose("config", overrides=[*SMALL, "max_tokens=0.5"]))
