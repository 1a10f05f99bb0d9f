"""``python -m attnlab.check_device [--device cuda] [--only FORMS] [--quick] [--json PATH] [--imports MODULES]``:
every registered form and layer stage on a device against the CPU, in one table. Run it first on a new machine (a
cluster's GPU node) before a sweep.

For each registered form (:func:`~attnlab.forms.list_forms`, at :meth:`~attnlab.forms.Form.base_config`: causal
for a causal-only form), each of its named settings (:func:`~attnlab.forms.form_settings`), and each stage it
computes (every field of :class:`~attnlab.config.AttentionConfig` at its samples, ``attnlab.config.field_info``,
that the form or the layer claims: :func:`~attnlab.stages.claims_of`), one small
:class:`~attnlab.attention.MultiHeadAttention` layer (B 2, L 12, d_model 16, 2 heads, its parameters drawn from
N(0, 0.5²)) is checked, in training mode, against the same layer on the CPU through ``eager`` (every stage in turn,
materialised: the reference) in float64:

* **float64**: a forward and a backward on the device through the backend the layer chooses there (``auto``), with
  the same weights, input and upstream gradient: the largest absolute difference from the reference of the output,
  and of the gradients (the input's and every parameter's). ok when each is at most :data:`FLOAT64_TOLERANCE` ×
  max(1, the reference's largest magnitude).
* **bf16**: the layer in float32 under ``torch.autocast(<device>, dtype=torch.bfloat16)`` (the CPU's autocast on
  the CPU), forward and backward: every value finite, and the output's and the input gradient's error relative to
  the float64 reference (‖bf16 − reference‖ / ‖reference‖) at most :data:`BF16_TOLERANCE` (5 %), or
  :data:`BF16_FACTOR` (4) times the error of the same layer's ``eager`` step in bf16 autocast on the CPU where that
  is larger: rounding to 8 significant bits is what it is (an ill-conditioned layer, like ``rowsum`` of signed
  logits, loses more); a device may not lose much more than the plain computation does.
* the backend the layer chose for each (recorded from the call itself), and the seconds.

Each row is ``ok``, ``FAIL: <the one-line error or the difference>`` (exit status 1), or ``refused: <why>`` when
the device refuses the layer in one line (a kernel for another device, a forced backend that cannot run there: a
``ValueError``, ``NotImplementedError`` or the chooser's ``cannot run here``), which is no failure. A stage sample
that the form does not compute (refused when the layer is built, whatever the device: a window mask on a causal-only
form) is left out of the table, and counted under it. A form registered by a user (``@register_form``, in a module
that ``--imports`` names) is checked with no edit here. ``--quick``: the first sample each form computes of each
field instead of every sample.

Exit status: 0 when every row is ok or refused, 1 when one failed, 2 for a bad command line (one line).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch
from rich.table import Table
from torch import Tensor

from attnlab.attention import MultiHeadAttention
from attnlab.backends import build_backend
from attnlab.config import FIELDS, AttentionConfig, field_default, field_info
from attnlab.console import plain_console, printable
from attnlab.forms import form_class, form_for, form_settings, list_forms
from attnlab.stages import claims_of

__all__ = [
    "BF16_FACTOR",
    "BF16_TOLERANCE",
    "FLOAT64_TOLERANCE",
    "SHAPE",
    "Case",
    "Row",
    "bf16_bound",
    "build_layer",
    "cases",
    "check_case",
    "main",
    "parse_args",
    "print_table",
    "run_checks",
    "stage_label",
    "to_device",
]

SHAPE: dict[str, int] = {"batch": 2, "length": 12, "d_model": 16, "num_heads": 2}
"""The checked layer's sizes: small, so that the whole check takes seconds (d_k = d_model / heads = 8)."""
FLOAT64_TOLERANCE = 1e-8
"""float64: the largest |device − CPU reference| allowed, relative to max(1, the reference's largest magnitude)
(float64's machine epsilon is 2.2e-16: a difference near this is a different computation, not rounding)."""
BF16_TOLERANCE = 5e-2
"""bf16 autocast: the error ‖bf16 − float64 reference‖ / ‖reference‖ always allowed, for the output and the input
gradient (bfloat16 keeps 8 significant bits: 2⁻⁸ ≈ 3.9e-3 a rounding, a dozen of them through a layer)."""
BF16_FACTOR = 4.0
"""bf16 autocast: the error allowed beyond :data:`BF16_TOLERANCE`, as a multiple of what the layer's ``eager``
step loses in bf16 autocast on the CPU (its rounding, not the device's)."""

NOT_COMPUTED = "not computed"


class UsageError(Exception):
    """A bad command line: one line, exit status 2."""


@dataclass(frozen=True)
class Case:
    """One layer to check: ``form`` is the row's form label (a form, or ``<form>_<setting>``), ``stage`` what is
    set beside the form's base config (``base``, ``qk_norm=rmsnorm`` ...), ``config`` the layer's config (None when
    it could not be made: ``error`` says why)."""

    form: str
    stage: str
    config: AttentionConfig | None
    error: str = ""


@dataclass
class Row:
    """The outcome of one :class:`Case` (a row of the table and of ``--json``). ``status``: ``ok``, ``FAIL``,
    ``refused`` or ``not computed`` (the form does not compute this stage: left out of the table); ``reason`` the
    one line of a status other than ok; the differences None where not measured."""

    form: str
    stage: str
    status: str = "ok"
    reason: str = ""
    backend: str = ""
    """the backend the layer chose on the device in float64."""
    backend_bf16: str = ""
    """the backend it chose under bf16 autocast."""
    float64_out: float | None = None
    float64_grad: float | None = None
    bf16_out: float | None = None
    bf16_grad: float | None = None
    eager_bf16_out: float | None = None
    """the yardstick: the relative error of the layer's ``eager`` step in bf16 autocast on the CPU (output)."""
    eager_bf16_grad: float | None = None
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------- what is checked


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_shown(v)}" for k, v in value.items())
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def stage_label(name: str, value: Any) -> str:
    """A short label of field ``name`` at ``value``: ``qk_norm=rmsnorm``, ``differential``, ``rope(base=100)``,
    ``mask=sliding_window(window=2)``."""
    if value is True:
        return name
    if isinstance(value, dict):
        rest = {k: v for k, v in value.items() if k != "name"}
        head = f"{name}={value['name']}" if "name" in value else name
        return f"{head}({_shown(rest)})" if rest else head
    return f"{name}={_shown(value)}"


def _claimed(config: AttentionConfig, name: str) -> bool:
    """Whether the form of ``config`` or the layer's stages claim field ``name`` at its value."""
    claims = claims_of(form_class(form_for(config)))
    allowed = claims.get(name, ())
    return name in claims and (allowed is None or getattr(config, name) in allowed)


def _with_sample(base: AttentionConfig, name: str, value: Any) -> tuple[str, AttentionConfig | None, str]:
    """(label, ``base`` with field ``name`` at ``value`` and the fields the sample requires (those still at their
    defaults), or None when that is ``base`` itself or cannot be made; the one line of why it cannot be made)."""
    info = field_info(name)
    needed = {k: v for k, v in info["requires"].items() if getattr(base, k) == field_default(k)}
    label = " · ".join([*(stage_label(k, v) for k, v in needed.items()), stage_label(name, value)])
    try:
        config = base.replace(**needed, **{name: value})
    except ValueError as exc:
        return label, None, _one_line(exc)
    return label, (None if config == base else config), ""


def cases(forms: Sequence[str] | None = None, every_sample: bool = True) -> list[Case]:
    """The layers to check, from the registries now: for each form (default: every registered one) its base
    config, each of its named settings at it, and each stage sample the form or the layer claims (every sample of
    each field, or with ``every_sample=False`` the first one the form claims); the form's own ``score`` samples
    where they leave the layer the same form (``dot`` and ``additive`` of the softmax form)."""
    found: list[Case] = []
    for setting in form_settings():
        if forms is not None and setting.form not in forms and setting.label not in forms:
            continue
        base = form_class(setting.form).base_config()
        if setting.params:
            found.append(Case(setting.label, "base", base.replace(score_params=dict(setting.params))))
            continue
        found.append(Case(setting.label, "base", base))
        for name in FIELDS:
            info = field_info(name)
            if info["role"] == "form" and name != "score":
                continue
            taken = 0
            for value in info["samples"]:
                if not every_sample and taken:
                    break
                label, config, error = _with_sample(base, name, value)
                if error:
                    found.append(Case(setting.label, label, None, error))
                    continue
                if config is None:
                    continue
                if name == "score":
                    if form_for(config) != setting.form:
                        continue  # another form's name (a decay form's score is the form itself)
                elif not _claimed(config, name):
                    continue  # a stage this form does not take: refused whatever the device (docs/variants.md)
                found.append(Case(setting.label, label, config))
                taken += 1
    return found


# ---------------------------------------------------------------------------------------------- one layer


def to_device(layer: MultiHeadAttention, device: torch.device) -> MultiHeadAttention:
    """A copy of ``layer`` (its weights, buffers and configuration) on ``device``: what the device rows run (the
    reference runs ``layer`` itself on the CPU)."""
    return copy.deepcopy(layer).to(device)


def _draw_parameters(layer: MultiHeadAttention) -> MultiHeadAttention:
    """Every parameter drawn from N(0, 0.5²), seeded by its name (no term hides behind an initial zero or one)."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return layer


def build_layer(config: AttentionConfig) -> MultiHeadAttention:
    """The checked layer of ``config``: float64, on the CPU, in training mode, its parameters drawn."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(SHAPE["d_model"], SHAPE["num_heads"], config=config)
    return _draw_parameters(layer.double().train())


def _inputs() -> tuple[Tensor, Tensor]:
    """The input x (B, L, d_model) and the upstream gradient of the output, float64 on the CPU."""
    size = (SHAPE["batch"], SHAPE["length"], SHAPE["d_model"])
    x = torch.randn(size, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    upstream = torch.randn(size, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    return x, upstream


def _step(
    layer: MultiHeadAttention,
    x: Tensor,
    upstream: Tensor,
    context: AbstractContextManager[Any] | None = None,
    reference: bool = False,
) -> tuple[Tensor, dict[str, Tensor], str]:
    """One forward (under ``context``) and backward of ``layer`` on ``x`` → (the output, the gradients of the input
    and of every parameter, on the CPU in float64; the backend the call ran: ``eager`` for the ``reference``, else
    the one the layer chose)."""
    chosen: list[str] = []
    x = x.detach().clone().requires_grad_(True)
    original = layer.compute

    def recording(backend: Any, *args: Any, **kwargs: Any) -> Any:
        chosen.append(backend.name)
        return original(backend, *args, **kwargs)

    layer.compute = recording  # type: ignore[method-assign]  (this instance only: what forward chose)
    try:
        with context or nullcontext():
            out = layer.compute(build_backend("eager"), x, None, None).out if reference else layer(x)[0]
        (out * upstream.to(out.dtype)).sum().backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)  # (an asynchronous kernel error is this row's)
    finally:
        del layer.compute
    grads = {"input": x.grad if x.grad is not None else torch.zeros_like(x)}
    grads |= {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    as_ref = {k: g.detach().to("cpu", torch.float64) for k, g in grads.items()}
    return out.detach().to("cpu", torch.float64), as_ref, "+".join(dict.fromkeys(chosen)) or "?"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return printable(f"{type(exc).__name__}: {text}")


def _refusal(exc: BaseException) -> str | None:
    """The one line of a device's refusal (a kernel or backend that does not run there), or None for a failure."""
    if isinstance(exc, ValueError | NotImplementedError):
        return _one_line(exc)
    if isinstance(exc, RuntimeError) and "cannot run here" in str(exc):
        return _one_line(exc)
    return None


def _max_abs(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _relative(a: Tensor, ref: Tensor) -> float:
    """‖a − ref‖ / ‖ref‖ (Frobenius; 0 for two zero tensors)."""
    scale = float(ref.norm())
    return float((a - ref).norm()) / scale if scale > 0 else float((a - ref).norm())


def _magnitude(t: Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def check_case(case: Case, device: torch.device) -> Row:
    """The row of ``case`` on ``device`` (module docstring): the reference on the CPU, then float64 and bf16 on the
    device."""
    started = time.perf_counter()
    row = Row(case.form, case.stage)
    try:
        _check(case, device, row)
    finally:
        row.seconds = time.perf_counter() - started
    return row


def bf16_bound(eager: float | None) -> float:
    """The relative error allowed under bf16 autocast, given the layer's ``eager`` step's in bf16 on the CPU (None
    when it did not run): :data:`BF16_TOLERANCE`, or :data:`BF16_FACTOR` × ``eager`` where that is larger."""
    return BF16_TOLERANCE if eager is None else max(BF16_TOLERANCE, BF16_FACTOR * eager)


def _check(case: Case, device: torch.device, row: Row) -> None:
    if case.config is None:
        row.status, row.reason = NOT_COMPUTED, case.error
        return
    try:
        layer = build_layer(case.config)
    except ValueError as exc:  # the form's or a stage's one line: whatever the device
        row.status, row.reason = NOT_COMPUTED, _one_line(exc)
        return
    except Exception as exc:  # (any other error building it is this row's failure)
        row.status, row.reason = "FAIL", f"building the layer: {_one_line(exc)}"
        return
    x, upstream = _inputs()
    try:
        ref, ref_grads, _ = _step(layer, x, upstream, reference=True)
    except Exception as exc:
        row.status, row.reason = "FAIL", f"the CPU reference: {_one_line(exc)}"
        return
    failures: list[str] = []

    # float64 on the device
    try:
        out, grads, row.backend = _step(to_device(layer, device), x.to(device), upstream.to(device))
    except Exception as exc:
        why = _refusal(exc)
        row.status, row.reason = ("refused", why) if why else ("FAIL", f"float64: {_one_line(exc)}")
        return
    if set(grads) != set(ref_grads):
        failures.append(f"float64: the device layer's parameters differ ({sorted(set(grads) ^ set(ref_grads))})")
    row.float64_out = _max_abs(out, ref)
    row.float64_grad = max((_max_abs(grads[k], ref_grads[k]) for k in grads.keys() & ref_grads.keys()), default=0.0)
    if not row.float64_out <= FLOAT64_TOLERANCE * max(1.0, _magnitude(ref)):
        failures.append(f"float64 output differs by {row.float64_out:.1e}")
    worst = max((_magnitude(g) for g in ref_grads.values()), default=0.0)
    if not row.float64_grad <= FLOAT64_TOLERANCE * max(1.0, worst):
        failures.append(f"float64 gradient differs by {row.float64_grad:.1e}")

    # bf16 autocast on the device (the layer in float32, as a bf16-mixed training step has it), against the float64
    # reference, with what the plain computation loses in bf16 on the CPU as the yardstick
    try:
        low = copy.deepcopy(layer).float()
        eager_autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        out, grads, _ = _step(low, x.float(), upstream.float(), eager_autocast, reference=True)
        row.eager_bf16_out, row.eager_bf16_grad = _relative(out, ref), _relative(grads["input"], ref_grads["input"])
    except Exception:  # (no yardstick: the fixed tolerance alone)
        pass
    try:
        low = to_device(layer, device).float()
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)
        out, grads, row.backend_bf16 = _step(low, x.float().to(device), upstream.float().to(device), autocast)
    except Exception as exc:
        why = _refusal(exc)
        if why and not failures:
            row.status, row.reason = "refused", f"bf16: {why}"
            return
        failures.append(f"bf16: {why or _one_line(exc)}")
    else:
        if not all(torch.isfinite(g).all() for g in (out, *grads.values())):
            failures.append("bf16: a non-finite value (output or gradient)")
        row.bf16_out = _relative(out, ref)
        row.bf16_grad = _relative(grads["input"], ref_grads["input"])
        for what, err, eager in (
            ("output", row.bf16_out, row.eager_bf16_out),
            ("input gradient", row.bf16_grad, row.eager_bf16_grad),
        ):
            bound = bf16_bound(eager)
            if not err <= bound:
                failures.append(f"bf16 {what}'s relative error {err:.1e} > {bound:.1e}")
    if failures:
        row.status, row.reason = "FAIL", "; ".join(failures)


# ---------------------------------------------------------------------------------------------- the run


def run_checks(
    device: torch.device,
    forms: Sequence[str] | None = None,
    every_sample: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[Row]:
    """Every row of :func:`cases` (``forms``: the forms or setting labels to check, default all) on ``device``;
    ``log`` gets one line per form as it ends (the progress). The CPU's side runs on one thread (the layers are
    tiny: more threads only wait for each other, ten times slower on a busy machine); the setting is restored."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():  # (torch's notice that RMSNorm under autocast takes its unfused path)
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            return _run(device, cases(forms, every_sample), log)
    finally:
        torch.set_num_threads(previous)


def _run(device: torch.device, todo: list[Case], log: Callable[[str], None] | None) -> list[Row]:
    labels = list(dict.fromkeys(c.form for c in todo))
    rows: list[Row] = []
    for number, label in enumerate(labels, start=1):
        started = time.perf_counter()
        mine = [check_case(c, device) for c in todo if c.form == label]
        rows += mine
        if log is not None:
            counts = {s: sum(r.status == s for r in mine) for s in ("ok", "FAIL", "refused")}
            shown = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing computed"
            log(f"[{number}/{len(labels)}] {label}: {shown} ({time.perf_counter() - started:.1f} s)")
    return rows


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _pair(out: float | None, grad: float | None, marks: tuple[str, str] = ("", "")) -> str:
    if out is None and grad is None:
        return "-"
    return f"{_number(out)}{marks[0]} / {_number(grad)}{marks[1]}"


def _raised(value: float | None, eager: float | None) -> str:
    """``*`` on a bf16 error above :data:`BF16_TOLERANCE` that the layer's own eager bf16 error allows."""
    return "*" if value is not None and BF16_TOLERANCE < value <= bf16_bound(eager) else ""


TABLE_WIDTH = 150
"""The table's width when the output is not a terminal (a log file, a pipe); a terminal's own width otherwise."""


def print_table(rows: Sequence[Row], device: torch.device, seconds: float, file: IO[str] | None = None) -> None:
    """The rows as one Rich table (those the forms do not compute left out, and counted), with the tolerances."""
    shown = [r for r in rows if r.status != NOT_COMPUTED]
    counts = {s: sum(r.status == s for r in shown) for s in ("ok", "refused", "FAIL")}
    table = Table(
        title=f"attnlab device check: {_device_name(device)} against the CPU (torch {torch.__version__})",
        title_justify="left",
        caption=(
            f"f64: max |device − CPU eager| in float64 of the output / the gradients (input and parameters), ok ≤ "
            f"{FLOAT64_TOLERANCE:g}·max(1, max |reference|). bf16: under bf16 autocast, finite, and ‖bf16 − float64‖ "
            f"/ ‖float64‖ of the output / the input gradient ≤ {BF16_TOLERANCE:g}, or (*) within {BF16_FACTOR:g}× "
            f"the error of the layer's own eager step in bf16 on the CPU (--json has it). "
            f"{len(shown)} layers: {counts['ok']} ok, {counts['refused']} refused, {counts['FAIL']} FAIL; "
            f"{len(rows) - len(shown)} stage samples left out (their form does not compute them, on any device); "
            f"{seconds:.1f} s."
        ),
        caption_justify="left",
    )
    table.add_column("form", no_wrap=True)
    table.add_column("stage", overflow="fold", min_width=16)
    table.add_column("backend f64 / bf16", overflow="fold", min_width=12)
    table.add_column("f64 out / grad", justify="right", no_wrap=True)
    table.add_column("bf16 out / grad", justify="right", no_wrap=True)
    table.add_column("status", overflow="fold", min_width=8)
    for r in shown:
        backend = r.backend if r.backend_bf16 in ("", r.backend) else f"{r.backend} / {r.backend_bf16}"
        status = r.status if r.status == "ok" else f"{r.status}: {r.reason}"
        f64 = _pair(r.float64_out, r.float64_grad)
        marks = (_raised(r.bf16_out, r.eager_bf16_out), _raised(r.bf16_grad, r.eager_bf16_grad))
        bf16 = _pair(r.bf16_out, r.bf16_grad, marks)
        table.add_row(r.form, r.stage, backend or "-", f64, bf16, status, style="red" if r.status == "FAIL" else None)
    plain_console(file=file, width=TABLE_WIDTH).print(table)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


# ---------------------------------------------------------------------------------------------- the command line


DESCRIPTION = (
    "Every registered form and layer stage on a device against the CPU (float64, then bf16 autocast), and the "
    "backend each layer takes there, in one table: run it first on a new machine, before a sweep."
)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (:class:`UsageError`) instead of the usage and an exit."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(message)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options (``--help``); :class:`UsageError` (one line) for a bad one: an unknown form, a device torch
    cannot use here."""
    p = _Parser(prog="python -m attnlab.check_device", description=DESCRIPTION)
    p.add_argument(
        "--device", default=_default_device(), help="the device to check (default: cuda if torch sees one, else cpu)"
    )
    p.add_argument(
        "--only", default=None, help="comma-separated forms (or setting labels: gla_channel) to check (default: all)"
    )
    p.add_argument("--quick", action="store_true", help="one sample of each stage per form instead of every sample")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON to this file")
    p.add_argument(
        "--imports",
        default=None,
        help="comma-separated modules to import first, which register your forms (as a run's imports=[...])",
    )
    a = p.parse_args(argv)
    for name in [] if a.imports is None else [n.strip() for n in a.imports.split(",") if n.strip()]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # (any error in the user's module, in one line)
            raise UsageError(f"--imports: cannot import '{name}': {_one_line(exc)}") from None
    try:
        a.device = torch.device(a.device)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"--device {a.device}: {' '.join(str(exc).split())}") from None
    if a.device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("torch sees no CUDA device here; run it on the machine with the GPU, or --device cpu")
        if a.device.index is not None and a.device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {a.device}: torch sees {torch.cuda.device_count()} CUDA device(s) here")
    elif a.device.type != "cpu":
        try:
            torch.empty(1, device=a.device)
        except Exception as exc:  # (whatever the device type says, in one line)
            raise UsageError(f"--device {a.device}: torch cannot use it here ({' '.join(str(exc).split())})") from None
    if a.only is not None:
        a.only = [f.strip() for f in a.only.split(",") if f.strip()]
        known = [*list_forms(), *(s.label for s in form_settings() if s.params)]
        unknown = [f for f in a.only if f not in known]
        if unknown or not a.only:
            raise UsageError(
                f"--only: unknown form(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}"
            )
    if a.json is not None and not a.json.parent.is_dir():
        raise UsageError(f"--json {a.json}: no folder {a.json.parent}")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnlab.check_device``: the table on stdout, the progress on stderr → the exit status (0 every
    row ok or refused, 1 a FAIL, 2 a bad command line)."""
    try:
        opts = parse_args(argv)
    except UsageError as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return 2

    def log(line: str) -> None:
        print(printable(line), file=sys.stderr, flush=True)

    log(f"checking the forms on {_device_name(opts.device)} against the CPU (float64, then bf16 autocast) ...")
    started = time.perf_counter()
    rows = run_checks(opts.device, opts.only, every_sample=not opts.quick, log=log)
    seconds = time.perf_counter() - started
    print_table(rows, opts.device, seconds, file=sys.stdout)
    failed = any(r.status == "FAIL" for r in rows)
    if opts.json is not None:
        report = {
            "device": str(opts.device),
            "device_name": _device_name(opts.device),
            "torch": torch.__version__,
            "shape": SHAPE,
            "tolerances": {"float64": FLOAT64_TOLERANCE, "bf16": BF16_TOLERANCE, "bf16_factor": BF16_FACTOR},
            "seconds": seconds,
            "ok": not failed,
            "rows": [asdict(r) for r in rows],
        }
        try:
            opts.json.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:
            print(f"error: --json {printable(str(opts.json))}: {_one_line(exc)}", file=sys.stderr)
            return 2
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
