# ruff: noqa: E501
"""Every stage and preset gives the numbers of attnlab 0.2 (commit 928ac7c, before AttentionConfig, the position
biases' own module and the backends registry): 47 encoders, both paths (the fused backends and ``need_weights``'s
eager path), outputs and gradients.

The values were printed at commit 928ac7c by the script this test runs (float64, one thread): the loss (h·c), two
output entries, and the absolute sums of two weight gradients. They matched bit for bit on the refactored code;
the test allows 1e-12 (relative), as a BLAS may sum in another order.
"""

from __future__ import annotations

import pytest
import torch

import attnlab

pytestmark = pytest.mark.usefixtures("single_thread")

WINDOW = {"name": "and", "masks": ["causal", {"name": "sliding_window", "window": 3}]}
# (name, Encoder keyword arguments, [(h·c).sum, h[0,1,0], h_eager[1,8,3], |∂q_proj₀|₁, |∂v_proj₁|₁ (eager)])
PINNED = [
    ('additive', {'score': 'additive'}, [-3.8085775163919657, -0.2094893225373973, -0.8990690698877822, 21.320792190556443, 255.6958884735912]),
    ('additive+causal', {'score': 'additive', 'mask': 'causal'}, [-7.465429627195455, -0.15546938969884508, -0.9194996160218394, 13.352208262701163, 283.30226245790845]),
    ('dot', {'score': 'dot'}, [-3.5859382731245395, -0.428931805941976, -1.4055412876414648, 88.78864300308709, 217.02574427560288]),
    ('dot+causal', {'score': 'dot', 'mask': 'causal'}, [-3.2438631750130145, -0.4060883828929993, -1.412148418305258, 67.36991388496769, 240.74273721384984]),
    ('general', {'score': 'general'}, [-6.085089842526475, -0.07386330846943134, -1.128428097921675, 111.11736750624536, 154.52965976792984]),
    ('general+causal', {'score': 'general', 'mask': 'causal'}, [-4.982224548153301, 0.060552615181257, -1.1377204634119713, 87.57943411733376, 178.8969773743684]),
    ('scaled_dot', {'score': 'scaled_dot'}, [-2.405425184948335, -0.44241846011568187, -1.4264756611842673, 47.95568825462871, 196.63049212631427]),
    ('scaled_dot+causal', {'score': 'scaled_dot', 'mask': 'causal'}, [-2.0041503334164767, -0.3799094691088179, -1.4295996023960242, 37.33718983683633, 239.45019374999129]),
    ('cosine', {'score': 'cosine'}, [-5.795766673950672, -0.36790817417425425, -1.3952514859594571, 514.3304203816233, 308.6856597207749]),
    ('cosine+causal', {'score': 'cosine', 'mask': 'causal'}, [-7.658660357908394, -0.40461707603993635, -1.4580118677951484, 303.68862671247666, 302.89273301881167]),
    ('alibi', {'score': 'alibi'}, [-2.170413650141674, -0.4192039336352145, -1.3500225006592115, 48.418769939965145, 200.53879061154834]),
    ('alibi+causal', {'score': 'alibi', 'mask': 'causal'}, [-1.8125832777301616, -0.3763098250974897, -1.3637722874896612, 35.98521877572213, 243.1349598063406]),
    ('t5_bias', {'score': 't5_bias'}, [-4.929594995446889, -0.13495836544004133, -1.1120774462029241, 89.71184594908699, 207.87754130405227]),
    ('t5_bias+causal', {'score': 't5_bias', 'mask': 'causal'}, [-5.838574030795272, -0.3495371469935325, -1.042867848040036, 71.21819865576829, 255.1576063888297]),
    ('relative_position', {'score': 'relative_position'}, [-9.240897393654437, -0.5369375391225271, -1.3930347782304915, 51.38649858054259, 242.70482489316424]),
    ('relative_position+causal', {'score': 'relative_position', 'mask': 'causal'}, [-6.569661650064663, -0.4895363105370673, -1.4008120353878364, 46.225756457748716, 281.8424211463633]),
    ('rope', {'score': 'scaled_dot', 'pos_encoding': 'rope'}, [9.287169863499688, -0.5619847875817418, -0.21263183086768733, 56.4804551837561, 179.1220813387606]),
    ('rope_frac', {'score': 'scaled_dot', 'pos_encoding': 'rope', 'rope': {'fraction': 0.5, 'base': 100.0}}, [9.268409986527313, -0.5624917711233993, -0.21348974122549783, 56.69808837597321, 179.56730597563458]),
    ('diff', {'score': 'scaled_dot', 'differential': True}, [-6.225982762663693, -0.45773321943802153, -1.7378210327509112, 136.75071075517678, 204.9540205662537]),
    ('diff+causal', {'score': 'scaled_dot', 'differential': True, 'mask': 'causal'}, [2.112272501791713, -0.7535028615884248, -1.7074135261020082, 115.00197571617602, 286.21793517264626]),
    ('norm_softmax1', {'normalizer': 'softmax1'}, [-2.39739964706431, -0.4536504068252427, -1.4393239852668525, 43.50523786519105, 176.68190510928014]),
    ('norm_softmax1+causal', {'normalizer': 'softmax1', 'mask': 'causal'}, [-3.91982398094557, -0.39708594615576037, -1.4442333092358808, 41.33338523436161, 176.98558321508685]),
    ('norm_sink', {'normalizer': 'sink'}, [-2.39739964706431, -0.4536504068252427, -1.4393239852668525, 43.50523786519105, 176.68190510928014]),
    ('norm_sink+causal', {'normalizer': 'sink', 'mask': 'causal'}, [-3.91982398094557, -0.39708594615576037, -1.4442333092358808, 41.33338523436161, 176.98558321508685]),
    ('norm_sigmoid', {'normalizer': 'sigmoid'}, [-3.4181470350767214, -0.46319414483172805, -1.4719906321894167, 51.24421834699723, 181.3468120906014]),
    ('norm_sigmoid+causal', {'normalizer': 'sigmoid', 'mask': 'causal'}, [-4.047416069618295, -0.39838744483990846, -1.468629112496156, 41.160595067676184, 180.9414312633003]),
    ('norm_sparsemax', {'normalizer': 'sparsemax'}, [-4.72751366854007, -0.3763453624694274, -1.3398821567767105, 205.34604292921713, 275.30375996164037]),
    ('norm_sparsemax+causal', {'normalizer': 'sparsemax', 'mask': 'causal'}, [-4.210010539064486, -0.41283672071538424, -1.3483112313088863, 118.47003391451301, 259.38501559558824]),
    ('norm_entmax15', {'normalizer': 'entmax15'}, [-4.610115128564561, -0.41555608086146656, -1.406605198251163, 119.74507700633113, 233.8388562961742]),
    ('norm_entmax15+causal', {'normalizer': 'entmax15', 'mask': 'causal'}, [-3.714701809551713, -0.3968930972798235, -1.4111244433035766, 74.30966340922949, 244.18031219487466]),
    ('norm_softpick', {'normalizer': 'softpick'}, [-3.7982477355640123, -0.5913224366496098, -1.4893927423568631, 130.84672329460497, 149.58413887647646]),
    ('norm_softpick+causal', {'normalizer': 'softpick', 'mask': 'causal'}, [-6.868741963952999, -0.5244405847337192, -1.4820365160870075, 169.40430153229028, 191.31220907825823]),
    ('pb_shaw', {'position_bias': 'shaw'}, [-9.240897393654437, -0.5369375391225271, -1.3930347782304915, 51.38649858054259, 242.70482489316424]),
    ('pb_shaw+additive', {'score': 'additive', 'position_bias': 'shaw', 'mask': 'causal'}, [-9.305262611941199, -0.2364084230266199, -1.159643523766922, 41.62520036884065, 294.0820665910013]),
    ('pb_t5', {'position_bias': 't5'}, [-3.962292412676568, -0.14499733665113648, -1.0843487100191358, 47.84931762424054, 191.4899786252505]),
    ('pb_t5+additive', {'score': 'additive', 'position_bias': 't5', 'mask': 'causal'}, [-5.842269854499691, -0.7990683952282057, -1.0018213241292062, 14.062779707912936, 253.4193536477333]),
    ('pb_alibi', {'position_bias': 'alibi'}, [-2.170413650141674, -0.4192039336352145, -1.3500225006592115, 48.418769939965145, 200.53879061154834]),
    ('pb_alibi+additive', {'score': 'additive', 'position_bias': 'alibi', 'mask': 'causal'}, [-7.0250926996195595, -0.14899761828481603, -0.9106999804884452, 13.09820910434424, 282.83017063920664]),
    ('qk_rms', {'qk_norm': 'rmsnorm'}, [-4.455179700316349, -0.3925939217958603, -1.4713621771661398, 124.8791421254657, 234.7095933546654]),
    ('qk_ln_dot', {'qk_norm': 'layernorm', 'score': 'dot'}, [-4.922112402507119, -0.37491988616476624, -1.63933126379984, 232.17271489860013, 264.0826637485099]),
    ('softcap', {'softcap': 5.0}, [-2.3888439220022164, -0.44218192606463347, -1.4267639803266954, 47.630713902423864, 196.35346794325787]),
    ('kv1', {'num_kv_heads': 1}, [-4.4779643759994805, -0.3314304630678452, -1.1069557652616369, 30.384948274786705, 66.08989223666384]),
    ('kv2_causal_window', {'num_kv_heads': 2, 'mask': WINDOW}, [-5.869731873462687, -0.48267943895977566, -1.2490978500244228, 32.453314156053914, 219.1711287265565]),
    ('dv', {'d_v': 6, 'd_k': 5}, [-10.752217939110231, -0.623597426163313, -1.4195007074813155, 60.39562665244581, 250.05963023692613]),
    ('shaw_value', {'score': 'relative_position', 'score_params': {'clip': 2, 'value_term': True}}, [-14.618913050138742, -0.6231484798289941, -1.4293780013216408, 80.13267532341412, 211.41654768759525]),
    ('mix', {'score': 'additive', 'position_bias': 'alibi', 'qk_norm': 'rmsnorm', 'softcap': 50.0, 'num_kv_heads': 2, 'normalizer': 'softmax1', 'pos_encoding': 'rope'}, [5.485016857140444, -0.5003291427098577, -0.9113751898294395, 13.429837190798505, 76.6386915846737]),
    ('padded', {'pad_id': 0}, [-6.3833237798531695, -0.3856573512942995, -1.3327250731523352, 42.30624333906296, 229.2084584580671]),
]  # fmt: skip


def _encoder_run(kwargs: dict) -> dict[str, torch.Tensor]:
    """The numbers pinned above for one encoder: built from seed 0, fixed tokens and cotangent, both paths."""
    out = {}
    c = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for need_weights in (False, True):
        torch.manual_seed(0)
        enc = attnlab.Encoder(vocab_size=11, d_model=16, num_heads=4, num_layers=2, **kwargs).double()
        tokens = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(1))
        result = enc(tokens, need_weights=need_weights)
        h = result[0] if need_weights else result
        (h * c).sum().backward()
        if need_weights:
            out["eager"] = h[1, 8, 3]
            out["dv"] = enc.layers[1].self_attn.v_proj.weight.grad.abs().sum()
        else:
            out["loss"], out["h"] = (h * c).sum(), h[0, 1, 0]
            out["dq"] = enc.layers[0].self_attn.q_proj.weight.grad.abs().sum()
    return out


@pytest.mark.parametrize(("name", "kwargs", "pinned"), PINNED, ids=[p[0] for p in PINNED])
def test_every_stage_gives_the_numbers_of_0_2(name, kwargs, pinned):
    got = _encoder_run(kwargs)
    values = [got[k].item() for k in ("loss", "h", "eager", "dq", "dv")]
    for value, expected in zip(values, pinned, strict=True):
        assert value == pytest.approx(expected, rel=1e-12, abs=1e-14), name
