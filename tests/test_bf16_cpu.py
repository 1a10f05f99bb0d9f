"""bfloat16 on a CPU: ``trainer.precision=bf16-mixed`` (torch's CPU autocast) trains every variant.

* Every ``conf/variant/*.yaml`` (found in the folder, so a new variant is covered), built as the training code builds
  it (``validate_config``, ``build_module``), takes one training step under CPU bf16 autocast: a finite loss, finite
  gradients, and no backend whose kernel computes float32/64 only (``relative``, ``normalized``) is chosen.
* The backends see autocast's dtype (:func:`~attnlab.backends.compute_dtype`): ``auto`` falls through to one that
  computes bfloat16, a forced one refuses in one line (at the call here, and at validation in
  tests/test_refusals.py).
* t5_bias and relative_position under bf16 against float32 (the same model, loose: bf16 has 8 bits of mantissa).
* One real command line in this process: ``variant=t5_bias trainer.precision=bf16-mixed`` trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import read_summary, run_cli
from hydra import compose, initialize_config_dir

import attnlab
from attnlab.backends import FLOAT32_64, Conditions, build_backend, compute_dtype
from attnlab.training.config import CONF_DIR, build_module, validate_config

pytestmark = pytest.mark.usefixtures("single_thread")

VARIANTS = sorted(p.stem for p in (Path(CONF_DIR) / "variant").glob("*.yaml"))
EXTRA = {"custom": ["variant.name=scaled_dot"]}  # variant=custom needs a registered score's name
TINY = ["task=digits", "d_model=16", "num_heads=2", "num_layers=2", "logger=none", "diagnostics.enabled=false"]
B, L = 2, 16
FLOAT_ONLY = [n for n in attnlab.list_backends() if n in ("relative", "normalized")]


@contextmanager
def hydra() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def build(variant: str, *overrides: str, seed: int = 0) -> torch.nn.Module:
    """The module of ``variant=<variant>`` on TINY, as the training code builds it (train mode)."""
    with hydra():
        cfg = compose("config", overrides=[*TINY, f"variant={variant}", *EXTRA.get(variant, []), *overrides])
        datamodule = validate_config(cfg)
    torch.manual_seed(seed)
    return build_module(cfg, datamodule).train()


def batch(module: torch.nn.Module, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random tokens (B, L) and labels of the module's task shape."""
    gen = torch.Generator().manual_seed(seed)
    hp = module.hparams
    tokens = torch.randint(1, int(hp["vocab_size"]), (B, L), generator=gen)
    labels = torch.randint(0, int(hp["num_classes"]), (B, L) if hp["per_token"] else (B,), generator=gen)
    return tokens, labels


def test_the_variants_are_found() -> None:
    assert {"scaled_dot", "t5_bias", "relative_position", "linear", "retnet"} <= set(VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_trains_a_step_under_cpu_bf16_autocast(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = build(variant)
    chosen: list[tuple[str, torch.dtype]] = []
    choose = attnlab.backends.choose_backend

    def watch(attn, when):  # the backend of each call, and the dtype it was chosen for
        backend = choose(attn, when)
        chosen.append((backend.name, when.dtype))
        return backend

    monkeypatch.setattr(attnlab.attention, "choose_backend", watch)
    tokens, labels = batch(module, seed=len(variant))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module._loss((tokens, labels))[0]
    loss.backward()
    assert torch.isfinite(loss), f"{variant}: loss {loss}"
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    assert grads, f"{variant}: no gradient"
    bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
    assert not bad, f"{variant}: non-finite gradients in {bad}"
    attention_grads = [g for n, g in grads.items() if "attn" in n and g.abs().sum() > 0]
    assert attention_grads, f"{variant}: the attention got no gradient"
    assert chosen, f"{variant}: no attention layer called"
    assert all(dtype == torch.bfloat16 for _, dtype in chosen), chosen  # what autocast computes in
    assert not [name for name, _ in chosen if name in FLOAT_ONLY], chosen


@pytest.mark.parametrize(("variant", "backend32"), [("t5_bias", "tiled"), ("relative_position", "tiled")])
def test_bf16_is_float32_within_bf16_rounding(variant: str, backend32: str) -> None:
    """The same model and batch in float32 (the tiled kernel) and under bf16 autocast (another backend):
    logits and the position table's gradient agree to bf16's precision (~2⁻⁸ per rounding)."""
    module = build(variant, seed=3)
    attn = module.encoder.layers[0].self_attn
    assert attn.backend_for("cpu", torch.float32) == backend32
    assert attn.backend_for("cpu", torch.bfloat16) not in FLOAT_ONLY
    tokens, labels = batch(module, seed=4)
    results = []
    for autocast in (False, True):
        module.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = module(tokens)
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        loss.backward()
        table = [p.grad.clone() for n, p in module.named_parameters() if "position_bias" in n and p.grad is not None]
        results.append((logits.float().detach(), torch.cat([t.flatten() for t in table])))
    (out32, g32), (out16, g16) = results
    assert (out16 - out32).norm() / out32.norm() < 2e-2
    assert g32.norm() > 0 and (g16 - g32).norm() / g32.norm() < 5e-2


def test_the_conditions_take_autocasts_dtype() -> None:
    assert compute_dtype(torch.float32, "cpu") == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(torch.float32, "cpu") == torch.bfloat16
        assert compute_dtype(torch.float64, "cpu") == torch.float64  # autocast leaves float64 alone
        x = torch.randn(1, 5, 8)
        assert Conditions.of(x, False).dtype == torch.bfloat16
        assert Conditions.of(x.double(), False).dtype == torch.float64
    assert compute_dtype(torch.float32, "cpu") == torch.float32


@pytest.mark.parametrize(
    "options",
    [
        {"position_bias": "t5", "backend": "relative"},
        {"score": "relative_position", "clip": 2, "backend": "relative"},
        {"softcap": 5.0, "backend": "normalized"},
        {"normalizer": "sparsemax", "backend": "normalized"},
    ],
    ids=lambda o: f"{o['backend']}-{o.get('position_bias') or o.get('score') or o.get('normalizer') or 'softcap'}",
)
def test_a_float_only_backend_says_so_and_auto_falls_through(options: dict) -> None:
    """Forced: one line at the call (and at validation: tests/test_refusals.py); auto: another backend, which
    trains. Without autocast the same layer runs the forced backend."""
    forced = attnlab.MultiHeadAttention(8, 2, 4, **options).train()
    auto = attnlab.MultiHeadAttention(8, 2, 4, **{**options, "backend": "auto"}).train()
    auto.load_state_dict(forced.state_dict())
    x = torch.randn(2, 6, 8)
    name = options["backend"]
    assert build_backend(name).call_reason(forced, Conditions(dtype=torch.float32)) is None
    reason = build_backend(name).call_reason(forced, Conditions(dtype=torch.bfloat16))
    assert reason == "it computes float32 and float64, not torch.bfloat16"  # (autocast's dtype, not the input's)
    assert FLOAT32_64 == (torch.float32, torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=rf"^attention.backend={name} cannot run here: it computes float32"):
            forced(x)
        out = auto(x)[0]
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all()
    assert forced(x)[0].dtype == torch.float32  # float32: the forced backend runs


def test_bf16_mixed_trains_t5_bias_from_the_command_line(tmp_path: Path, restore_process_state: None) -> None:
    run = tmp_path / "run"
    proc = run_cli(
        "variant=t5_bias",
        "trainer.precision=bf16-mixed",
        "debug=fast",
        "max_steps=2",
        "eval_every=2",
        "batch_size=4",
        "d_model=16",
        "num_heads=2",
        "logger=none",
        "diagnostics.enabled=false",
        "results_table=false",
        f"hydra.run.dir={run}",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "error" not in proc.stderr.lower() and "could not be counted" not in proc.stdout + proc.stderr
    summary = read_summary(run)
    assert summary["status"] == "ok", summary.get("reason")
    assert summary["steps"] == 2 and summary["flops_per_token"] > 0
