"""Encoder: shapes, fast vs eager, padding, positional encodings, user extensions."""

import math
import uuid

import pytest
import torch
from helpers import grid, score_cases
from torch import nn

import attnlab

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB, D_MODEL, H, LAYERS, B, L = 13, 6, 2, 2, 2, 6


def make_encoder(seed=0, **kwargs):
    torch.manual_seed(seed)
    params = {"vocab_size": VOCAB, "d_model": D_MODEL, "num_heads": H, "num_layers": LAYERS}
    params.update(kwargs)
    return attnlab.Encoder(**params).double().eval()


def tokens_with_pads(pad_id=0):
    gen = torch.Generator().manual_seed(0)
    t = torch.randint(1, VOCAB, (B, L), generator=gen)
    t[t == pad_id] = 1 if pad_id != 1 else 2
    t[0, 4:] = pad_id
    t[1, 2] = pad_id  # a pad in the middle, too
    return t


def mhas(enc):
    found = [m for m in enc.modules() if isinstance(m, attnlab.MultiHeadAttention)]
    return found


def token_embedding(enc):
    (emb,) = [m for m in enc.modules() if isinstance(m, nn.Embedding) and m.num_embeddings == VOCAB]
    return emb


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("pos_encoding", ["sinusoidal", "learned", "none"])
def test_encoder_output_shape(pos_encoding, norm_first):
    enc = make_encoder(pos_encoding=pos_encoding, norm_first=norm_first)
    tokens = torch.randint(0, VOCAB, (B, L))
    h = enc(tokens)
    assert h.shape == (B, L, D_MODEL)
    assert torch.isfinite(h).all()
    assert sum(isinstance(m, attnlab.EncoderLayer) for m in enc.modules()) == LAYERS


def test_d_k_defaults_to_d_model_over_heads():
    enc = attnlab.Encoder(VOCAB, 12, 3, 2, score="general")
    for mha in mhas(enc):
        assert mha.q_proj.weight.shape == (12, 12)
        assert mha.v_proj.weight.shape == (12, 12)
        assert mha.score.weight.shape == (3, 4, 4)  # per-head d_k = 12 // 3
    enc = attnlab.Encoder(VOCAB, 10, 3, 2, d_k=4, d_v=2)
    for mha in mhas(enc):
        assert mha.q_proj.weight.shape == (12, 10)
        assert mha.k_proj.weight.shape == (12, 10)
        assert mha.v_proj.weight.shape == (6, 10)
        assert mha.out_proj.weight.shape == (10, 6)


def test_score_name_and_params_reach_every_layer():
    enc = make_encoder(score="relative_position", score_params={"clip": 2})
    for mha in mhas(enc):
        assert mha.position_bias.rel_k.shape == (5, D_MODEL // H)
    enc = make_encoder(score="t5_bias", score_params={"num_buckets": 8})
    assert all(m.position_bias.rel_bias.shape == (8, H) for m in mhas(enc))


# every registered built-in with its test parameters, and Shaw's value term
SCORES = [
    *((name, params) for _, name, params in score_cases()),
    ("relative_position", {"clip": 2, "value_term": True}),
]


@pytest.mark.parametrize("setup", ["plain", "causal+pad", "window+lengths"])
@pytest.mark.parametrize("score,params", SCORES, ids=[f"{s}{'_v' if p.get('value_term') else ''}" for s, p in SCORES])
def test_return_attention_gives_per_layer_outputs_and_same_h(score, params, setup, ref):
    """The eager (need_weights=True) and fast paths give the same h; weights/logits are (B, H, L, L)."""
    kwargs = {"score": score, "score_params": params}
    lengths = None
    if setup == "causal+pad":
        kwargs.update(mask="causal", pad_id=0)
    elif setup == "window+lengths":
        kwargs.update(mask=attnlab.build_mask("sliding_window", window=2))
        lengths = torch.tensor([L, 3])
    enc = make_encoder(**kwargs)
    ref.randomize_(enc, seed=1, scale=0.5)
    tokens = tokens_with_pads()
    h = enc(tokens, lengths=lengths)
    h2, atts = enc(tokens, lengths=lengths, need_weights=True)
    torch.testing.assert_close(h2, h, rtol=1e-10, atol=1e-10)
    assert len(atts) == LAYERS
    for att in atts:
        assert att.weights.shape == (B, H, L, L)
        assert att.logits.shape == (B, H, L, L)
        assert not torch.isnan(att.weights).any()
    if setup == "causal+pad":
        visible = grid(L, L, lambda i, j: j <= i)[None] & (tokens != 0)[:, None, :]
    elif setup == "window+lengths":
        visible = grid(L, L, lambda i, j: abs(i - j) < 2)[None] & (torch.arange(L)[None, :] < lengths[:, None])[:, None]
    else:
        visible = torch.ones(B, L, L, dtype=torch.bool)
    visible = visible[:, None].expand(B, H, L, L)
    for att in atts:
        assert torch.all(att.weights[~visible] == 0)
        has_key = visible.any(-1)
        sums = att.weights.sum(-1)[has_key]
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-12)
    inputs = [p for p in enc.parameters()]
    for g, g2 in zip(ref.grads(h, inputs), ref.grads(h2, inputs), strict=True):
        torch.testing.assert_close(g, g2, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm_first", [True, False])
def test_pad_embedding_content_does_not_reach_non_pad_outputs(norm_first, ref):
    enc = make_encoder(pad_id=0, norm_first=norm_first)
    ref.randomize_(enc, seed=2, scale=0.5)
    tokens = tokens_with_pads(0)
    before = enc(tokens).detach()
    with torch.no_grad():
        token_embedding(enc).weight[0] += 10 * ref.randn(D_MODEL, seed=3)
    after = enc(tokens).detach()
    real = tokens != 0
    torch.testing.assert_close(after[real], before[real], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(after[~real], before[~real]), "perturbation did not reach the pad positions"


def test_tokens_beyond_lengths_do_not_reach_valid_outputs(ref):
    enc = make_encoder()
    ref.randomize_(enc, seed=4, scale=0.5)
    lengths = torch.tensor([L, 3])
    tokens = tokens_with_pads(0)
    other = tokens.clone()
    other[1, 3:] = (other[1, 3:] + 5) % VOCAB
    a, b = enc(tokens, lengths=lengths), enc(other, lengths=lengths)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1, :3], b[1, :3], rtol=1e-12, atol=1e-12)
    _, atts = enc(tokens, lengths=lengths, return_attention=True)
    for att in atts:
        assert torch.all(att.weights[1, :, :, 3:] == 0)


def test_pad_id_keys_stay_masked_when_lengths_are_also_given(ref):
    """pad_id masking is AND-ed with everything: passing lengths must not re-open pads inside the length."""
    enc = make_encoder(pad_id=0)
    ref.randomize_(enc, seed=4, scale=0.5)
    tokens = tokens_with_pads(0)  # sequence 1 has a pad at position 2, inside lengths[1] = L
    lengths = torch.tensor([4, L])
    _, atts = enc(tokens, lengths=lengths, return_attention=True)
    visible = (tokens != 0) & (torch.arange(L)[None, :] < lengths[:, None])  # (B, Lk)
    for att in atts:
        assert torch.all(att.weights.permute(0, 3, 1, 2)[~visible] == 0)
    with_lengths = enc(tokens, lengths=lengths)
    torch.testing.assert_close(with_lengths, enc(tokens), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask", ["causal", "mask_object"])
def test_causal_encoder_outputs_ignore_future_tokens(mask, ref):
    enc = make_encoder(mask="causal" if mask == "causal" else attnlab.build_mask("causal"))
    ref.randomize_(enc, seed=5, scale=0.5)
    tokens = tokens_with_pads(0)
    other = tokens.clone()
    other[:, 3] = (other[:, 3] + 1) % VOCAB
    a, b = enc(tokens), enc(other)
    torch.testing.assert_close(a[:, :3], b[:, :3], rtol=0, atol=0)
    assert not torch.allclose(a[:, 3:], b[:, 3:])


def test_mask_name_and_mask_object_are_equivalent(ref):
    a = make_encoder(mask="causal", pad_id=0)
    b = make_encoder(mask=attnlab.build_mask("causal"), pad_id=0)
    ref.randomize_(a, seed=6, scale=0.5)
    b.load_state_dict(a.state_dict())
    tokens = tokens_with_pads(0)
    torch.testing.assert_close(a(tokens), b(tokens), rtol=0, atol=0)


def test_no_position_encoding_makes_encoder_permutation_equivariant(ref):
    enc = make_encoder(pos_encoding="none", score="scaled_dot")
    ref.randomize_(enc, seed=7, scale=0.5)
    tokens = torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(1))
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    torch.testing.assert_close(enc(tokens[:, perm]), enc(tokens)[:, perm], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pos_encoding", ["sinusoidal", "learned"])
def test_position_encoding_breaks_permutation_equivariance(pos_encoding, ref):
    enc = make_encoder(pos_encoding=pos_encoding, score="scaled_dot")
    ref.randomize_(enc, seed=7, scale=0.5)
    tokens = torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(1))
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    assert not torch.allclose(enc(tokens[:, perm]), enc(tokens)[:, perm], atol=1e-6)


def first_layer_input(enc, tokens):
    """The hidden states entering the first EncoderLayer, captured with a forward pre-hook."""
    layer = next(m for m in enc.modules() if isinstance(m, attnlab.EncoderLayer))
    seen = []

    def hook(module, args, kwargs):
        tensors = [a for a in [*args, *kwargs.values()] if torch.is_tensor(a) and a.is_floating_point()]
        seen.append(tensors[0].detach().clone())

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            enc(tokens)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("d_model", [6, 8])
def test_sinusoidal_encoding_matches_textbook_formula(d_model):
    """(embedding + PE) - (embedding alone) for identical weights is PE[pos, 2i] = sin(pos / 10000^(2i/d)),
    PE[pos, 2i+1] = cos(pos / 10000^(2i/d)), independent of any embedding scale."""
    sin_enc = make_encoder(d_model=d_model, pos_encoding="sinusoidal", max_len=32)
    none_enc = make_encoder(d_model=d_model, pos_encoding="none", max_len=32)
    none_enc.load_state_dict(sin_enc.state_dict(), strict=False)
    tokens = torch.randint(0, VOCAB, (B, 7), generator=torch.Generator().manual_seed(2))
    diff = first_layer_input(sin_enc, tokens) - first_layer_input(none_enc, tokens)
    pe = torch.zeros(7, d_model, dtype=torch.float64)
    for pos in range(7):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            pe[pos, 2 * i] = math.sin(angle)
            pe[pos, 2 * i + 1] = math.cos(angle)
    for b in range(B):
        torch.testing.assert_close(diff[b], pe, rtol=1e-6, atol=1e-6)


def test_all_parameters_receive_gradients(ref):
    enc = make_encoder(pos_encoding="learned", score="general").train()
    tokens = torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(3))
    enc(tokens).pow(2).sum().backward()
    missing = [n for n, p in enc.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


# ---------------------------------------------------------------- user extensions
def test_user_function_score_and_mask_work_through_encoder(ref):
    score_name = f"test_enc_cosine_{uuid.uuid4().hex[:8]}"
    mask_name = f"test_enc_dilated_{uuid.uuid4().hex[:8]}"

    @attnlab.register_score(score_name)
    def cosine(q, k, scale=5.0):
        return scale * (q / q.norm(dim=-1, keepdim=True)) @ (k / k.norm(dim=-1, keepdim=True)).transpose(-1, -2)

    @attnlab.register_mask(mask_name)
    def dilated(q_idx, kv_idx):
        return (q_idx - kv_idx) % 2 == 0

    enc = make_encoder(score=score_name, score_params={"scale": 3.0}, mask=mask_name, pad_id=0)
    ref.randomize_(enc, seed=8, scale=0.5)
    tokens = tokens_with_pads(0)
    h = enc(tokens)
    h2, atts = enc(tokens, return_attention=True)
    torch.testing.assert_close(h, h2, rtol=1e-10, atol=1e-10)
    visible = grid(L, L, lambda i, j: (i - j) % 2 == 0)[None, None] & (tokens != 0)[:, None, None, :]
    for att in atts:
        assert torch.all(att.weights[~visible.expand(B, H, L, L)] == 0)
        assert torch.all(att.logits.abs() <= 3.0 + 1e-12)
    # logits of the first layer are 3 * cosine of that layer's projected q, k
    mha = mhas(enc)[0]
    seen = []
    handle = mha.q_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    enc(tokens, return_attention=True)
    handle.remove()
    q, k = ref.project_qk(mha, seen[0], H)
    cos = torch.einsum("bhid,bhjd->bhij", q, k) / (q.norm(dim=-1)[..., :, None] * k.norm(dim=-1)[..., None, :])
    torch.testing.assert_close(atts[0].logits, 3.0 * cos, rtol=1e-10, atol=1e-10)


def test_user_module_score_parameters_train_through_encoder():
    name = f"test_enc_temp_{uuid.uuid4().hex[:8]}"

    @attnlab.register_score(name)
    class HeadTemperature(nn.Module):
        def __init__(self, d_k, num_heads, init=1.0):
            super().__init__()
            self.temp = nn.Parameter(torch.full((num_heads,), float(init)))

        def forward(self, q, k):
            return self.temp[:, None, None] * (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5

    enc = make_encoder(score=name, score_params={"init": 0.7}, mask="causal")
    temps = [m.score.temp for m in mhas(enc)]
    assert all(isinstance(m.score, HeadTemperature) for m in mhas(enc))
    assert all(torch.equal(t, torch.full((H,), 0.7).double()) for t in temps)
    enc(torch.randint(0, VOCAB, (B, L))).pow(2).sum().backward()
    for t in temps:
        assert t.grad is not None and t.grad.abs().sum() > 0
