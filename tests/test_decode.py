"""Decoding one token at a time (:mod:`attnlab.decode`) gives what the parallel forward gives (float64), for softmax
with a key/value cache and for every recurrent form (their state update), with short convolutions, rotary positions
and grouped heads; a softmax cache grows with the context and a recurrent state does not; what cannot decode is
refused in one line; and the benchmark's ``decode`` section reports each model against softmax."""

from __future__ import annotations

import pytest
import torch

from attnlab.bench.cases import quick_plan, recurrent_forms
from attnlab.bench.report import evaluate_targets, format_decode
from attnlab.bench.sections import bench_decode
from attnlab.config import AttentionConfig
from attnlab.decode import decode, encoder_step, init_cache
from attnlab.encoder import Encoder

# every recurrent form beside linear attention, from the registry's tags (retnet, gla, deltanet, gated_deltanet and
# any form registered before collection): the forms the decode section benches
FORMS = list(recurrent_forms())
WINDOW = {"name": "and", "masks": ["causal", {"name": "sliding_window", "window": 3}]}
CASES = {
    "softmax": ({"mask": "causal"}, "sinusoidal"),
    "softmax_window": ({"mask": WINDOW}, "learned"),
    "softmax_rope_mqa_qknorm": ({"mask": "causal", "rope": {}, "num_kv_heads": 1, "qk_norm": "rmsnorm"}, "rope"),
    "sigmoid_short_conv": ({"mask": "causal", "normalizer": "sigmoid", "short_conv": 2}, "sinusoidal"),
    "linear_elu_short_conv": ({"mask": "causal", "score": "linear", "normalizer": "rowsum", "short_conv": 3}, "none"),
    **{
        f"{f}_short_conv": ({"mask": "causal", "score": f, "normalizer": "none", "short_conv": 4}, "none")
        for f in FORMS
    },
    **{
        f"{f}_rope_gqa": ({"mask": "causal", "score": f, "normalizer": "none", "rope": {}, "num_kv_heads": 1}, "rope")
        for f in FORMS
    },
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


@pytest.mark.parametrize("form", ["scaled_dot", "gated_deltanet"])
def test_a_softmax_cache_grows_with_the_context_and_a_recurrent_state_does_not(form):
    options = {"mask": "causal"} if form == "scaled_dot" else {"mask": "causal", "score": form, "normalizer": "none"}
    encoder = _encoder(options, "sinusoidal")
    cache = init_cache(encoder)
    sizes = []
    with torch.no_grad():
        for t in range(20):
            encoder_step(encoder, torch.tensor([t % 40]), cache)
            sizes.append(sum(c.nbytes() for c in cache))
    per_token = 2 * 2 * (2 * 8) * 8  # layers × (k, v) × (H·d_k) floats × 8 bytes
    if form == "scaled_dot":
        assert sizes == [per_token * (t + 1) for t in range(20)]
    else:
        assert set(sizes) == {2 * 2 * 8 * 8 * 8}  # layers × H·d_k·d_v floats × 8 bytes, from the first token


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
    assert {r["variant"] for r in rows} == {"scaled_dot", "linear_elu", *FORMS}
    assert {r["length"] for r in rows} == set(plan.decode_contexts)
    assert all(r["tokens_per_s"] > 0 and r["bytes_per_seq"] > 0 for r in rows)
    plan.quick = False  # judged: the memory of every recurrent form is the same at both contexts
    targets = evaluate_targets(plan, {"decode": rows})
    memory = [t for t in targets if t["id"] == "28b"]  # linear_elu and each recurrent form
    assert len(memory) == 1 + len(FORMS) and all(t["value"] == 1.0 and t["met"] for t in memory)
    assert len([t for t in targets if t["id"] == "28a"]) == 1 + len(FORMS)
    assert "| gated_deltanet | 64 |" in "\n".join(format_decode(rows))


@pytest.mark.parametrize("form", ["scaled_dot", "gated_deltanet", "linear"])
def test_decoding_an_empty_sequence_gives_what_the_forward_gives(form):
    options = {"mask": "causal", "score": form}
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
