"""What a resume may change: :func:`config_changes` lists the keys whose values differ between a run's config and
a new one, leaving out the neutral keys (:func:`~attnlab.runs.is_neutral`), a field of the ``attention`` node that
only mirrors a changed key (:func:`~attnlab.runs.attention_sources`), and the keys that a run of an older attnlab
lacks where the new value is what that run ran with (the ``_added_in_*`` tables). :data:`EXTENSION_KEYS` are the
keys a resume may raise.
"""

from __future__ import annotations

import functools
from typing import Any

from omegaconf import OmegaConf

from attnlab.runs import attention_sources, config_defaults, flatten_config, is_neutral
from attnlab.training.config.base import CONF_DIR

__all__ = ["EXTENSION_KEYS", "attention_sources", "config_changes", "config_defaults", "flatten_config", "is_neutral"]


# keys a resume may raise: training goes on past the original end (an extension)
EXTENSION_KEYS = ("max_steps", "trainer.max_steps", "max_tokens")


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The keys whose values differ between a run's config and a new one, as (key, old, new), leaving out the
    neutral keys (logger, threads, ...) that cannot change the numbers. A missing key reads as ``<absent>``; a
    top-level key that a run of an older attnlab lacks is no change when the new value is its default."""
    a, b = flatten_config(old), flatten_config(new)
    absent = "<absent>"
    defaults = config_defaults()
    added = {
        **_ADDED_IN_0_4,
        **_added_in_0_5(),
        **_added_in_0_6(),
        **_ADDED_IN_0_7,
        **(_added_defaults() if "attention" not in old else {}),
    }
    changes = [
        (key, a.get(key, absent), b.get(key, absent))
        for key in sorted(a.keys() | b.keys())
        if a.get(key, absent) != b.get(key, absent)
        and not is_neutral(key)
        and not (key not in a and "." not in key and key in defaults and defaults[key] == b.get(key))
        and not (key not in a and _added_default(added, key) in (b.get(key), _DERIVED))
    ]
    changed = [key for key, _, _ in changes]
    return [c for c in changes if not _mirrors_a_change(c[0], changed)]


def _mirrors_a_change(key: str, changed: list[str]) -> bool:
    """Whether ``key`` is a field of the ``attention`` node that interpolates a key which changed too
    (``attention.d_k`` ← ``d_k``, ``attention.score_params.clip`` ← ``variant.params``): a change is listed once,
    under the key that was set."""
    if not key.startswith("attention."):
        return False
    field = key.removeprefix("attention.").partition(".")[0]
    source = attention_sources().get(field)
    if source is None or source.startswith("attention."):
        return False
    sources = [source, "model.pos_encoding"] if field == "rope" else [source]
    return any(c == s or c.startswith(f"{s}.") for s in sources for c in changed)


def _added_default(added: dict[str, Any], key: str) -> Any:
    """What a run without ``key`` ran with, from ``added`` (by the key or the nearest node above it)."""
    while key:
        if key in added:
            return added[key]
        key = key.rpartition(".")[0]
    return "<not added>"


_DERIVED = object()

_ADDED_IN_0_4: dict[str, Any] = {
    "model.short_conv": None,
    "attention.short_conv": _DERIVED,
    "attention.backend_params": {},
    "model.layer_kinds.S": _DERIVED,
}
"""The keys that a run of attnlab 0.3 lacks, with the value it ran with (no short convolution, no backend
parameters)."""


_ADDED_IN_0_7: dict[str, Any] = {
    "attention.short_conv_residual": False,
    "attention.output_gate": None,
    "attention.selective": False,
    "model.canon": None,
    "model.canon_width": 4,
    "model.layer_kinds.M": _DERIVED,
    "model.layer_kinds.F": _DERIVED,
}
"""The keys that a run before issues 44 and 45 lacks (Canon layers, the gated output, the MLA and forgetting layer
kinds, selective attention), with the value it ran with: none of them."""


def _added_in_0_6() -> dict[str, Any]:
    """The keys that a run of attnlab 0.5 lacks (what the heads do: ``diagnostics.heads`` ...), with the value it ran
    with: none of it (a resume adds the new diagnostics from there on, which changes no trained number)."""
    return {key: value for key, value in config_defaults().items() if key in _DIAGNOSTICS_0_6}


_DIAGNOSTICS_0_6 = (
    "diagnostics.heads",
    "diagnostics.window",
    "diagnostics.near_keys",
    "diagnostics.importance",
    "diagnostics.random_orders",
)


def _added_in_0_5() -> dict[str, Any]:
    """The keys that a run of attnlab 0.4 lacks (the ``match`` node; ``max_tokens`` is a top-level default), with the
    value it ran with: no matching."""
    return {key: value for key, value in config_defaults().items() if key.startswith("match.")}


@functools.cache
def _added_defaults() -> dict[str, Any]:
    """The keys that a run of attnlab 0.2 (before the ``attention`` node and per-layer attention) lacks, with the
    value it ran with: the ``attention`` node's fields derive from keys such a run has (compared there), its
    ``backend`` was ``auto``, and every layer was alike."""
    model = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "default.yaml"), resolve=False)
    added: dict[str, Any] = {f"attention.{k}": _DERIVED for k in attention_sources()}
    added |= {"attention._target_": _DERIVED, "attention.backend": "auto", "model.rope.spectrum": "full"}
    for key in ("pattern", "local_window", "layers"):
        added[f"model.{key}"] = model.get(key)
    added["model.layer_kinds"] = _DERIVED
    return added
