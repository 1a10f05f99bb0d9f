"""The ``flex`` section: one :class:`~attnlab.attention.MultiHeadAttention` layer through the ``flex`` backend
(compiled FlexAttention: score_mod + BlockMask, one fused kernel) against the materialised ``eager`` path, and
against ``sdpa`` where SDPA computes the layer (a position bias as one float mask), for the configurations that
FlexAttention is for: ALiBi, T5 and Shaw position biases, soft-capping, a causal sliding window.

* On CUDA: a training step of the layer alone (forward, loss mean(out²), backward, AdamW), autocast to ``dtype``,
  at L 1024 and 4096 (8192 tokens per batch; d_model 512, H 8, d_k 64), the implementations of a configuration
  timed together, interleaved (:func:`~attnlab.bench.harness.interleaved_times`), medians. Rows ``mode``
  ``forward+backward``.
* On the CPU FlexAttention is forward-only (torch 2.13), so the rows time the forward alone under
  ``torch.no_grad()`` in float32, at one small length (L 256, 2048 tokens per batch; ``--quick``: L 128), and are
  labelled ``forward only (CPU)``: they say what a translation costs there, not what a training step would. Each
  configuration's first flex call compiles (9–45 s on a 2-core CPU): ``compile_s`` records it, outside the timings.

Each row: ``section`` ``flex``, ``group`` (L), ``label``, ``impl`` (``flex``, ``eager`` or ``sdpa``), ``variant``
(the configuration), ``options`` (:meth:`~attnlab.config.AttentionConfig.describe`), ``mode``, the shape's fields,
the medians (``median_ms`` …), ``reps``, ``tokens_per_s``, ``ratio_eager`` (median ÷ eager's, same
configuration), ``compile_s`` (flex only: the first call, compile included) and ``mask``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from attnlab.attention import MultiHeadAttention
from attnlab.backends import build_backend
from attnlab.bench.cases import Plan, Shape
from attnlab.bench.harness import _autocast, _summary, _sync, interleaved_times
from attnlab.config import AttentionConfig
from attnlab.masks import Mask, build_mask

__all__ = ["FLEX_CONFIGS", "bench_flex"]

WINDOW = 256
FLEX_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "alibi": ({"position_bias": "alibi"}, "causal"),
    "t5": ({"position_bias": "t5"}, "causal"),
    "shaw": ({"position_bias": "shaw", "position_bias_params": {"clip": 16}}, "none"),
    "softcap": ({"softcap": 30.0}, "causal"),
    "sliding_window": ({}, "causal_window"),
}
"""(layer options, mask) of each configuration timed: ``causal_window`` is causal AND a window of 256."""


def _mask(kind: str) -> Mask | None:
    if kind == "none":
        return None
    if kind == "causal":
        return build_mask("causal")
    return build_mask("causal") & build_mask({"name": "sliding_window", "window": WINDOW})


def _shapes(device: torch.device, quick: bool) -> list[Shape]:
    if device.type == "cuda":
        lengths = (1024,) if quick else (1024, 4096)
        return [Shape(8192 // n, n, 512, 8, 64, num_layers=1) for n in lengths]
    n = 128 if quick else 256
    return [Shape(2048 // n, n, 128, 4, 32, num_layers=1)]


def _step(
    layer: MultiHeadAttention, x: Tensor, mask: Mask | None, train: bool, device: torch.device, dtype: torch.dtype
) -> Callable[[], None]:
    """One training step of the layer (``train``), or one forward under no_grad."""
    if not train:
        layer.eval()

        def forward() -> None:
            with torch.no_grad():
                layer(x, mask=mask)

        return forward
    layer.train()
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            out = layer(x, mask=mask)[0]
        out.float().square().mean().backward()
        opt.step()

    return step


def bench_flex(plan: Plan, device: torch.device, dtype: torch.dtype, log: Callable[[str], None]) -> list[dict]:
    """Rows of the ``flex`` section (see the module's docstring): on CUDA training steps at L 1024 and 4096, on the
    CPU forward passes only (float32, whatever ``dtype``) at one small length."""
    train = device.type == "cuda"
    mode = "forward+backward" if train else "forward only (CPU)"
    if not train:
        dtype = torch.float32
        log("flex: CPU FlexAttention is forward-only in this torch: timing the forward under no_grad, float32")
    rows: list[dict] = []
    for shape in _shapes(device, plan.quick):
        x = torch.randn(shape.batch, shape.length, shape.d_model, generator=torch.Generator().manual_seed(0))
        x = x.to(device)
        for name, (options, mask_kind) in FLEX_CONFIGS.items():
            mask = _mask(mask_kind)
            impls = ["flex", "eager"]
            probe = MultiHeadAttention(shape.d_model, shape.num_heads, shape.d_k, **options)
            if build_backend("sdpa").config_reason(probe) is None:
                impls.append("sdpa")
            steps, layers = {}, {}
            for impl in impls:
                torch.manual_seed(0)
                config = AttentionConfig(**options, backend=impl)
                layers[impl] = MultiHeadAttention(shape.d_model, shape.num_heads, shape.d_k, config=config).to(device)
                steps[impl] = _step(layers[impl], x, mask, train, device, dtype)
            log(f"flex: {name} at {shape.tag()}, {', '.join(impls)} ({mode}; flex compiles first) ...")
            _sync(device)
            t0 = time.perf_counter()
            steps["flex"]()  # the compile, outside the timings
            _sync(device)
            compile_s = time.perf_counter() - t0
            times = interleaved_times(steps, plan.warmup, plan.reps, device)
            eager = statistics.median(times["eager"])
            for impl, ts in times.items():
                stats = _summary(ts)
                rows.append(
                    {
                        "section": "flex",
                        "group": f"L{shape.length}",
                        "label": f"{name} {impl} {shape.tag()}" + ("" if train else " forward only (CPU)"),
                        "impl": impl,
                        "score": layers[impl].config.score,
                        "variant": name,
                        "options": layers[impl].config.describe(),
                        "mask": mask_kind,
                        "mode": mode,
                        "backend": impl,
                        **asdict(shape),
                        **stats,
                        "reps": len(ts),
                        "tokens_per_s": shape.tokens / (stats["median_ms"] / 1e3),
                        "ratio_torch": None,
                        "ratio_eager": statistics.median(ts) / eager,
                        "compile_s": compile_s if impl == "flex" else None,
                    }
                )
            del steps, layers
    return rows
