"""Budgets and sizes: what a run may spend and how big its model is.

``max_tokens`` becomes ``max_steps`` (:func:`resolve_max_tokens`), and ``match`` sizes the model to a parameter or
state count (:func:`resolve_match`, by :func:`match_count` of models built on the meta device); both change the
config in place, so that config.yaml records what the run trained. :func:`_check_budgets` checks the ``max_tokens``
and ``match`` keys, and :func:`_check_memory` refuses, before anything is generated, a run whose data, attention
tensors, parameters (:func:`_parameter_count`) or layer state cannot fit in memory.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnlab.checks import check_choice, check_int
from attnlab.registry import unknown_name_message
from attnlab.runs import flatten_config
from attnlab.training.config.base import CONF_DIR, MAX_STEPS, ConfigError, _check, _on_meta, plain
from attnlab.training.config.compose import _with_variant, build_module, group_choices, resolve_d_k

__all__ = ["MATCH_BY", "MATCH_KEYS", "MATCH_MAX_WIDTH", "match_count", "resolve_match", "resolve_max_tokens"]


# ------------------------------------------------------------------------------------------ memory


def _memory_bytes(trainer: DictConfig) -> tuple[int, str]:
    """(bytes, where) of the memory the attention tensors will live in."""
    import torch

    if str(trainer.get("accelerator")) in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "GPU memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "memory"


def _quadratic(attention: Any) -> bool:
    """Whether a training step of this layer keeps (B, H, L, L) tensors: the backend ``auto`` chooses for it is
    ``eager`` or a row kernel, or SDPA with a float bias (a position bias) or two maps; the tiled kernel, flex and
    the O(L) backends keep none. Read from the layer's record (its features), not from a list of forms."""
    name = attention.backend_for()
    if name in ("tiled", "flex", "chunked", "global", "recurrent"):
        return False
    return name != "sdpa" or bool(attention.spec.features & {"position_bias", "differential", "value_term"})


def _check_memory(cfg: DictConfig, datamodule: Any, attention_layers: list[Any]) -> None:
    """Refuse, before generating anything, what cannot fit in memory: the model's parameters with their gradients
    and optimizer state, sequences whose data or dense attention tensors, and then the layers' state (the recurrent
    state or key/value cache :meth:`~attnlab.attention.MultiHeadAttention.state_size` reports) for a batch."""
    length, heads, layers = datamodule.max_len, cfg.num_heads, cfg.num_layers
    sequences = datamodule.num_train + datamodule.num_val + datamodule.num_test
    needs = [(sequences * length * 8 * (2 if datamodule.per_token else 1), "the token and label tensors")]
    if cfg.diagnostics.enabled:  # the probe runs the eager path: weights and logits of every layer, float32
        # (with diagnostics.heads, the repeated-token probe's too, while the first probe's are held)
        probes = 2 if cfg.diagnostics.get("heads") and getattr(datamodule, "no_token_probe", None) is None else 1
        # (DeltaProduct's effective matrix is over its L·n steps: n² the floats)
        steps = max((getattr(a.form, "householder_steps", 1) for a in attention_layers), default=1)
        needs.append(
            (probes * cfg.diagnostics.probe_size * heads * (length * steps) ** 2 * 8 * layers, "the diagnostics probe")
        )
    fused = not any(_quadratic(attention) for attention in attention_layers)
    if not fused:  # the eager path or SDPA's math kernel: (B, H, L, L) weights, logits and gradients per layer
        needs.append((cfg.batch_size * heads * length**2 * 4 * 3 * layers, "a training batch's attention"))
    params = _parameter_count(cfg, datamodule)
    if params is not None:  # weights, gradients and AdamW's two moments, float32
        needs.append((params * 4 * 4, f"{params:,} parameters with their gradients and optimizer state"))
    have, where = _memory_bytes(cfg.trainer)
    need, what = max(needs)
    if need > 0.8 * have and params is not None and what.endswith("optimizer state"):
        sizes = {"d_model": cfg.d_model, "d_k": cfg.d_k, "num_heads": cfg.num_heads, "num_layers": cfg.num_layers}
        sizes |= {"model.d_ff": cfg.model.d_ff, "model.d_v": cfg.model.d_v}
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items() if v is not None)
        raise ConfigError(
            f"{shown}: the model needs about {_size(need)} for {what}, more than the {_size(have)} of {where} here; "
            "choose smaller sizes"
        )
    if need > 0.8 * have:
        key = next((k for k in datamodule.length_keys if cfg.task.datamodule.get(k) is not None), None)
        setting = f"task.datamodule.{key}={cfg.task.datamodule[key]}" if key else f"task={cfg.task.name}"
        raise ConfigError(
            f"{setting}: sequences of {length} tokens need about {_size(need)} for {what}, more than the "
            f"{_size(have)} of {where} here; use shorter sequences (or a smaller batch / diagnostics.probe_size)"
        )
    # the layers' recurrent state or key/value cache: a linear feature map of 1e10 dimensions (taylor's d + d² + 1)
    state = sum(attention.state_size(length) for attention in attention_layers)
    if cfg.batch_size * state * 4 > 0.8 * have:  # a training batch's state (the chunked form holds more), float32
        variant = " ".join(
            [f"variant.name={cfg.variant.name}"]
            + [f"variant.params.{k}={v}" for k, v in (plain(cfg.variant.get("params")) or {}).items()]
        )
        raise ConfigError(
            f"{variant} (d_k={resolve_d_k(cfg)}, num_heads={heads}, num_layers={layers}): the layers' state is "
            f"{state:,} floats per sequence (state_size at {length} tokens), about {_size(cfg.batch_size * state * 4)} "
            f"for a batch of {cfg.batch_size}, more than the {_size(have)} of {where} here; choose a smaller state "
            "(variant.params, d_k, num_heads) or batch_size"
        )


def _parameter_count(cfg: DictConfig, datamodule: Any) -> int | None:
    """The model's parameter count, built on the meta device (no memory); None when it cannot be built there."""
    import torch

    try:
        with torch.device("meta"):
            return build_module(cfg, datamodule).num_parameters
    except Exception:
        return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


# ------------------------------------------------------------------------------------------ budgets

MATCH_KEYS = ("by", "width", "target", "reference")
MATCH_BY = ("params", "state_size")
MATCH_MAX_WIDTH = 1 << 20
"""The widest width that ``match`` tries (models are built on the meta device: no memory)."""


def _whole(name: str, value: Any) -> int | None:
    """``value`` as an integer >= 1, also when written as a float (``max_tokens=2e6``); None stays None."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return _check(check_int, name, value, minimum=1)


def _whole_key(cfg: DictConfig, key: str) -> int | None:
    """:func:`_whole` of ``cfg``'s ``key``, written back as an integer (config.yaml records ``2000000``, not
    ``2000000.0``)."""
    value = _whole(key, OmegaConf.select(cfg, key))
    if value is not None and type(OmegaConf.select(cfg, key)) is not int:
        OmegaConf.update(cfg, key, value)
    return value


def _check_budgets(cfg: DictConfig) -> None:
    """``max_tokens`` (null or an integer >= 1) and the ``match`` node: its keys, ``by`` with one target (a count or
    a reference variant), and ``width`` an integer key of the config."""
    _whole_key(cfg, "max_tokens")
    match = cfg.get("match")
    if match is None:
        return
    if not OmegaConf.is_dict(match):
        raise ConfigError(f"match must be a mapping of {', '.join(MATCH_KEYS)}, got {plain(match)!r}")
    unknown = sorted(set(map(str, match)) - set(MATCH_KEYS))
    if unknown:
        raise ConfigError(f"match has no key '{unknown[0]}'; its keys: {', '.join(MATCH_KEYS)}")
    by, target, reference = match.get("by"), match.get("target"), match.get("reference")
    if by is None:
        given = next((k for k in ("target", "reference") if match.get(k) is not None), None)
        if given:
            raise ConfigError(f"match.{given} is set but match.by is null: set match.by=params or match.by=state_size")
        return
    _check(check_choice, "match.by", by, MATCH_BY)
    _whole_key(cfg, "match.target")
    if (target is None) == (reference is None):
        both = "both are set" if target is not None else "neither is set"
        raise ConfigError(
            f"match.by={by} matches one count: set match.target=<count> or match.reference=<variant>, not both ({both})"
        )
    if reference is not None:
        choices = [c for c in group_choices(CONF_DIR, "variant") if c != "custom"]
        if not isinstance(reference, str) or reference not in choices:
            raise ConfigError(f"match.reference: {unknown_name_message('variant', str(reference), choices)}")
    _width_value(cfg, match.get("width"))


def _width_value(cfg: DictConfig, key: Any) -> int | None:
    """The value of ``match.width``'s key: an integer or null (its default: d_ff = 4·d_model, d_k = d_model / H).
    A parameter of a stage (``variant.params.<name>``) may be absent (the builder's default)."""
    import difflib
    import re

    if not isinstance(key, str) or not re.fullmatch(r"\w+(\.\w+)*", key):
        raise ConfigError(
            "match.width must name an integer key of the config (model.d_ff, d_k, variant.params.<name> ...), got "
            f"{key!r}"
        )
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    optional = parent_key.endswith("params")
    if not OmegaConf.is_dict(parent) or (leaf not in parent and not optional):
        keys = [k for k, v in flatten_config(plain(cfg)).items() if v is None or type(v) is int]
        close = difflib.get_close_matches(key, keys, n=1)
        hint = f"; did you mean {close[0]}?" if close else " (e.g. model.d_ff, d_k, variant.params.<name>)"
        raise ConfigError(f"match.width={key} is not a key of the config{hint}")
    value = parent.get(leaf)
    if value is not None and type(value) is not int:
        raise ConfigError(f"match.width={key}: {key} is {value!r}, not an integer (the width is searched in integers)")
    return value


def resolve_max_tokens(cfg: DictConfig, datamodule: Any) -> int | None:
    """With ``max_tokens`` set: ``max_steps`` = ceil(max_tokens / tokens per step), where a step takes batch_size ·
    seq_len (· ``trainer.accumulate_grad_batches``) token positions of one process, rounded up to a multiple of
    ``eval_every`` (the run validates, and saves its checkpoint, at its last step); set in ``cfg`` (``max_tokens``
    overrides ``max_steps``) and returned. None when ``max_tokens`` is null."""
    max_tokens = _whole("max_tokens", cfg.get("max_tokens"))
    if max_tokens is None:
        return None
    from attnlab.compute import tokens_per_step

    accumulate = cfg.trainer.get("accumulate_grad_batches") or 1
    per_step = tokens_per_step(datamodule.batch_size, datamodule.seq_len, accumulate=accumulate)
    steps = -(-max_tokens // per_step)
    steps = -(-steps // cfg.eval_every) * cfg.eval_every
    if steps > MAX_STEPS:
        most = MAX_STEPS // cfg.eval_every * cfg.eval_every * per_step
        raise ConfigError(
            f"max_tokens={max_tokens:.3g} makes {steps:.3g} steps of {per_step:,} tokens (batch_size × seq_len), "
            f"more than the {MAX_STEPS:,} steps a run may take; allowed: null or an integer from 1 to {most:,}"
        )
    OmegaConf.update(cfg, "max_steps", steps)
    return steps


def match_count(cfg: DictConfig, datamodule: Any, by: str, where: str = "") -> int:
    """The count that ``match.by`` matches, of the model ``cfg`` builds for ``datamodule`` (on the meta device):
    its parameters (``params``), or its layers' summed ``state_size`` at the task's longest sequence."""
    try:
        module = _on_meta(lambda: build_module(cfg, datamodule))
    except (TypeError, ValueError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"match: the model with {where or 'this config'} cannot be built: {message}") from None
    if by == "params":
        return int(module.num_parameters)
    length = module.hparams.get("max_len") or 0
    return int(sum(layer.self_attn.state_size(length) for layer in module.encoder.layers))


def resolve_match(cfg: DictConfig, datamodule: Any) -> dict[str, Any] | None:
    """``match.by`` set: the integer ``match.width`` whose model's count (:func:`match_count`) is closest to
    ``match.target``, or to the count of this config with ``variant=<match.reference>`` (and this run's width), by
    bisection (the count must not decrease as the width grows), set in ``cfg``; returns ``{by, width, value, target,
    achieved, reference}`` (``value`` the width found, ``achieved`` its count). None when ``match.by`` is null. One
    :class:`ConfigError` line when no width comes near the target. Check the config again afterwards
    (:func:`~attnlab.training.config.validate.validate_config`): the model has changed."""
    match = cfg.get("match")
    if match is None or match.get("by") is None:
        return None
    from attnlab.compute import Unreachable, closest_width

    by, key, reference = str(match.by), str(match.width), match.get("reference")
    if reference is not None:
        target = match_count(_with_variant(cfg, str(reference)), datamodule, by, f"variant={reference}")
    else:
        target = _whole("match.target", match.get("target"))

    def count(width: int) -> int:
        OmegaConf.update(cfg, key, width, force_add=True)
        return match_count(cfg, datamodule, by, f"{key}={width}")

    try:
        width, achieved = closest_width(count, target, high=MATCH_MAX_WIDTH)
    except Unreachable as exc:
        what = f"the {by} of variant={reference} ({target:,})" if reference is not None else f"{target:,} {by}"
        raise ConfigError(f"match.by={by}: no {key} reaches {what}: {exc}") from None
    OmegaConf.update(cfg, key, width, force_add=True)
    return {"by": by, "width": key, "value": width, "target": target, "achieved": achieved, "reference": reference}
