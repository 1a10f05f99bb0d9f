"""Decoding one token at a time (:mod:`attnlab.decode`) gives what the parallel forward gives (float64), for softmax
with a key/value cache and for every recurrent form at its defaults and at each of its named settings (their state
update), with short convolutions, rotary positions and grouped heads; a softmax cache grows with the context and a
recurrent state does not, and is the size the layer reports; what cannot decode is refused in one line; and the
benchmark's ``decode`` section reports each model against softmax."""

from __future__ import annotations

import pytest
import torch

from attnlab.bench.cases import DECODE_GOALS, quick_plan
from attnlab.bench.report import evaluate_targets, format_decode
from attnlab.bench.sections import bench_decode
from attnlab.config import AttentionConfig
from attnlab.decode import decode, encoder_step, init_cache
from attnlab.encoder import Encoder
from attnlab.forms import FormSetting, form_class, form_settings

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: threads only add overhead on a busy machine

# every recurrent form (linear attention, retnet, gla, deltanet, gated_deltanet, kda and any form registered before
# collection) at its defaults and at each of its named settings (gla_channel, gla_mamba2, deltanet_beta2, ...), read
# from the registry: FormSetting(label, form, params), the params the layer's score_params
SETTINGS = form_settings("recurrent")
# the rows the decode section benches beside softmax and linear_elu: every setting of a form that is not linear
# attention (linear attention is benched through its feature map, linear_elu)
BENCHED = [s.label for s in SETTINGS if "linear" not in form_class(s.form).tags]
WINDOW = {"name": "and", "masks": ["causal", {"name": "sliding_window", "window": 3}]}


def recurrent(setting: FormSetting, **options) -> dict:
    """The options of a causal layer of a form setting: ``score=<form>``, its params, the row-sum normalizer for
    linear attention and none for a decay or delta-rule form; plus ``options``."""
    normalizer = "rowsum" if "linear" in form_class(setting.form).tags else "none"
    return {
        "mask": "causal",
        "score": setting.form,
        "score_params": dict(setting.params),
        "normalizer": normalizer,
        **options,
    }


CASES = {
    "softmax": ({"mask": "causal"}, "sinusoidal"),
    "softmax_window": ({"mask": WINDOW}, "learned"),
    "softmax_rope_mqa_qknorm": ({"mask": "causal", "rope": {}, "num_kv_heads": 1, "qk_norm": "rmsnorm"}, "rope"),
    "sigmoid_short_conv": ({"mask": "causal", "normalizer": "sigmoid", "short_conv": 2}, "sinusoidal"),
    "linear_elu_short_conv": ({"mask": "causal", "score": "linear", "normalizer": "rowsum", "short_conv": 3}, "none"),
    **{f"{s.label}_short_conv": (recurrent(s, short_conv=4), "none") for s in SETTINGS},
    **{f"{s.label}_rope_gqa": (recurrent(s, rope={}, num_kv_heads=1), "rope") for s in SETTINGS},
}


def _encoder(options: dict, pos: str) -> Encoder:
    torch.manual_seed(0)
    config = AttentionConfig(**options)
    return Encoder(40, 16, 2, 2, max_len=64, pos_encoding=pos, attention=config).double().eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_token_by_token_decoding_gives_the_logits_of_the_parallel_forward(case):
    options, pos = CASES[case]
    encoder = _encoder(options, pos)
    head = torch.nn.Linear(16, 40).double()  # the logits, as a language model's head reads them
    tokens = torch.randint(0, 40, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(head(decode(encoder, tokens)), head(encoder(tokens)), rtol=1e-10, atol=1e-10)


def cache_sizes(encoder: Encoder, tokens: int) -> list[tuple[int, int]]:
    """(bytes the cache holds, bytes the layers report: B × 8 × Σ ``state_size``) after each of ``tokens`` tokens
    decoded one at a time, for a batch of 3."""
    cache, sizes = init_cache(encoder), []
    with torch.no_grad():
        for t in range(tokens):
            encoder_step(encoder, torch.tensor([t % 40, (t + 1) % 40, (t + 2) % 40]), cache)
            reported = 3 * 8 * sum(layer.self_attn.state_size(t + 1) for layer in encoder.layers)
            sizes.append((sum(c.nbytes() for c in cache), reported))
    return sizes


def test_a_softmax_cache_grows_with_the_context():
    sizes = cache_sizes(_encoder({"mask": "causal"}, "sinusoidal"), 20)
    per_token = 3 * 2 * 2 * (2 * 8) * 8  # B × layers × (k, v) × (H·d_k) floats × 8 bytes
    assert sizes == [(per_token * (t + 1), per_token * (t + 1)) for t in range(20)]  # (held, reported)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.label)
@pytest.mark.parametrize("short_conv", [None, 4], ids=["no_conv", "short_conv4"])
def test_a_recurrent_state_does_not_grow_with_the_context_and_is_the_size_reported(setting, short_conv):
    """From the first token on, the cache holds the same bytes, the ones the layers report (the state and the
    short convolution's last k − 1 inputs of q, k and v); a decay or delta-rule form's state is one d_k × d_v
    matrix per head. H = 2 query heads of d_k = 8, one key/value head, d_v = 4 (so that a size that counts d_k for
    d_v, or H heads for G, is wrong)."""
    options = recurrent(setting, short_conv=short_conv, d_v=4, num_kv_heads=1)
    sizes = cache_sizes(_encoder(options, "sinusoidal"), 20)
    assert len(set(sizes)) == 1 and sizes[0][0] == sizes[0][1], sizes
    if {"decay", "delta"} & form_class(setting.form).tags:
        n = setting.params.get("householder_steps", 2) if setting.form == "deltaproduct" else 1  # keys, values a token
        conv = 0 if short_conv is None else 3 * (2 * 8 + n * 8 + n * 4)  # (k − 1) × (q H·d_k, k n·G·d_k, v n·G·d_v)
        assert sizes[0][0] == 3 * 2 * (2 * 8 * 4 + conv) * 8  # B × layers × (H·d_k·d_v + conv) floats × 8 bytes


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"mask": None}, "only a causal layer"),
        ({"mask": "causal", "position_bias": "alibi"}, "position bias"),
        ({"mask": "causal", "differential": True}, "differential"),
    ],
)
def test_what_cannot_decode_is_refused_in_one_line(options, match):
    encoder = _encoder(options, "sinusoidal")
    with pytest.raises(ValueError, match=match) as err:
        init_cache(encoder)
    assert str(err.value).startswith("layer 1 cannot decode") and "\n" not in str(err.value)


def test_the_decode_section_reports_every_model_against_softmax():
    plan = quick_plan()
    rows = bench_decode(plan, torch.device("cpu"), torch.float32, lambda _: None)
    assert {r["variant"] for r in rows} == {"scaled_dot", "mla", "linear_elu", *BENCHED}
    assert {r["length"] for r in rows} == set(plan.decode_contexts)
    assert all(r["tokens_per_s"] > 0 and r["bytes_per_seq"] > 0 for r in rows)
    plan.quick = False  # judged: the memory of every recurrent row is the same at both contexts
    targets = evaluate_targets(plan, {"decode": rows})
    memory = [t for t in targets if t["id"] == "28b"]  # linear_elu and each recurrent row
    assert sorted(t["what"].split()[0] for t in memory) == sorted(["linear_elu", *BENCHED])
    assert all(t["value"] == 1.0 and t["met"] for t in memory)
    # multi-head latent attention's cache is judged by its bytes per token (44d): (kv_rank + rope_dim) floats a layer
    latent = [t for t in targets if t["id"] == "44d"]
    mla = next(r for r in rows if r["variant"] == "mla" and r["length"] == max(plan.decode_contexts))
    d_k = plan.decode_shape.d_k
    rope_dim = d_k // 6 * 2  # the defaults: rope_dim = d_k / 3 (even), kv_rank = 4 (d_k − rope_dim)
    assert mla["latent_floats"] == plan.decode_shape.num_layers * (4 * (d_k - rope_dim) + rope_dim)
    assert len(latent) == 1 and latent[0]["met"] and latent[0]["value"] == pytest.approx(1.0)
    # every row but the growing caches is judged once on its time per token (28a, or the goal that names it: 42e)
    timed = [t for t in targets if t["id"] in {goal[0] for goal in DECODE_GOALS}]
    assert sorted(t["what"].split()[0] for t in timed) == sorted(["linear_elu", *BENCHED])
    table = "\n".join(format_decode(rows))
    assert all(f"| {row} | 64 |" in table for row in BENCHED)


# (a short convolution once raised on an empty sequence: conv1d refuses an input shorter than its kernel; kda's preset
# has one)
@pytest.mark.parametrize("short_conv", [None, 4], ids=["no_conv", "short_conv4"])
@pytest.mark.parametrize("form", ["scaled_dot", "gated_deltanet", "kda", "linear"])
def test_decoding_an_empty_sequence_gives_what_the_forward_gives(form, short_conv):
    options = {"mask": "causal", "score": form, "short_conv": short_conv}
    options["normalizer"] = {"scaled_dot": "softmax", "linear": "rowsum"}.get(form, "none")
    encoder = _encoder(options, "sinusoidal")
    tokens = torch.zeros(3, 0, dtype=torch.long)
    with torch.no_grad():
        h, forward = decode(encoder, tokens), encoder(tokens)
    assert h.shape == forward.shape == (3, 0, 16) and h.dtype == forward.dtype == torch.float64


@pytest.mark.parametrize("form", ["scaled_dot", "gated_deltanet"])
@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda e, c: encoder_step(e, torch.tensor([1]), c),  # a recurrent state would broadcast it silently
            r"^the cache holds 3 sequences \(batch size 3, 1 token\(s\) each\), but tokens has 1: feed tokens of "
            r"shape \(3,\), or start a cache for 1 with init_cache\(encoder\)$",
        ),
        (
            lambda e, c: encoder_step(e, torch.zeros(3, 5, dtype=torch.long), c),
            r"^encoder_step takes tokens \(B,\), one per sequence, got shape \(3, 5\); for a whole sequence \(B, L\) "
            r"use decode\(encoder, tokens\)$",
        ),
        (lambda e, c: encoder_step(e, torch.tensor([1.0, 2.0, 3.0]), c), r"^encoder_step takes integer token ids"),
        (lambda e, c: encoder_step(e, torch.tensor([1, 2, 3]), c[:1]), r"^encoder_step needs the cache of this enc"),
        (lambda e, c: decode(e, torch.zeros(5, dtype=torch.long)), r"^decode takes tokens \(B, L\), got shape \(5,\)"),
    ],
)
def test_a_cache_of_another_batch_or_tokens_of_another_shape_are_refused_in_one_line(form, call, match):
    options = {"mask": "causal"} if form == "scaled_dot" else {"mask": "causal", "score": form, "normalizer": "none"}
    encoder = _encoder(options, "sinusoidal")
    cache = init_cache(encoder)
    with torch.no_grad():
        encoder_step(encoder, torch.tensor([1, 2, 3]), cache)
        with pytest.raises(ValueError, match=match) as err:
            call(encoder, cache)
    assert "\n" not in str(err.value)
    assert [c.length for c in cache] == [1, 1]  # the cache is as it was
