"""A softmax-family form costs one file (issue 60): README's learnable per-head temperature
(tests/user_softmax_form_example.py) is computed exactly on every backend that takes it, trains through
``imports=``, is a row of the bench's variants section and decodes, with no edit anywhere in attnlab."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import registered_here, train_listops

import attnlab
from attnlab.backends import build_backend, list_backends

NAME = "test_temperature"


@pytest.fixture
def temperature():
    """The user's module imported (its form registered), and the registry put back afterwards."""
    with registered_here("user_softmax_form_example"):
        yield importlib.import_module("user_softmax_form_example")


def reference(layer, x, mask):
    """softmax(e^{τ_h} q·k / √d_k) v per head, from the layer's own weights, written out."""
    B, L, _ = x.shape
    H, d = layer.num_heads, layer.d_k
    q = layer.q_proj(x).view(B, L, H, d).transpose(1, 2)
    k = layer.k_proj(x).view(B, L, H, d).transpose(1, 2)
    v = layer.v_proj(x).view(B, L, H, layer.d_v).transpose(1, 2)
    tau = layer.form.log_temperature.exp().view(1, H, 1, 1)
    logits = tau * (q @ k.transpose(-1, -2)) / d**0.5
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    z = torch.softmax(logits, -1) @ v
    return layer.out_proj(z.transpose(1, 2).reshape(B, L, H * layer.d_v))


@pytest.mark.parametrize("mask", [None, "causal"])
def test_the_temperature_form_is_computed_exactly_on_every_backend(temperature, mask):
    torch.manual_seed(0)
    config = attnlab.AttentionConfig(score=NAME, mask=mask)
    layer = attnlab.MultiHeadAttention(16, 2, config=config).double()
    with torch.no_grad():
        layer.form.log_temperature.copy_(torch.tensor([0.7, -0.4]))
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    allowed = None if mask is None else torch.ones(7, 7, dtype=torch.bool).tril()
    expected = reference(layer, x, allowed)
    computed = []
    for name in list_backends():
        backend = build_backend(name)
        if backend.config_reason(layer.spec) or backend.mask_reason(layer.mask_form):
            continue
        try:
            out = layer.compute(backend, x, None, None).out
        except RuntimeError as exc:  # a backend for another device (flex's CPU path is for no_grad)
            assert "cannot run" in str(exc) or "grad" in str(exc), exc
            continue
        torch.testing.assert_close(out, expected, msg=lambda m, n=name: f"{n}: {m}")
        computed.append(name)
    assert {"eager", "sdpa", "tiled"} <= set(computed)  # its computed_as: the softmax backends


def test_the_temperature_form_trains_through_imports(tmp_path, restore_process_state):
    with registered_here("user_softmax_form_example"):
        overrides = ["variant=custom", f"variant.name={NAME}", "imports=[user_softmax_form_example]", "num_layers=1"]
        summary = train_listops(tmp_path, *overrides, "threads=1")
    assert summary["status"] == "ok", summary["reason"]
    assert summary["settings"]["score"] == NAME and summary["backends"] == ["sdpa"]


def test_the_temperature_form_is_a_bench_row_and_decodes(temperature):
    from attnlab.bench.cases import ModelSpec, Shape, attention_variants, build_model
    from attnlab.decode import decode

    assert attention_variants()[NAME] == {"score": NAME}
    model = build_model(ModelSpec.of_variant(NAME, Shape(2, 8, 16, 2, 8, 1)))
    assert torch.isfinite(model(torch.randint(1, 10, (2, 8)))).all()

    config = attnlab.AttentionConfig(score=NAME, mask="causal")
    enc = attnlab.Encoder(vocab_size=20, d_model=16, num_heads=2, num_layers=1, attention=config).double().eval()
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.1 * torch.randn_like(p))
        tokens = torch.randint(1, 20, (2, 9))
        torch.testing.assert_close(decode(enc, tokens), enc(tokens))
