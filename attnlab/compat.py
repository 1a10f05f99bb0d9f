"""Old names, in one place: every name that moved (or whose call changed) and still reads from its old path, the
name to use instead, and the version it goes away in (:data:`MOVED`, old path → new path; timm's way: the old
import keeps working, with a warning, until the version named).

    from attnlab.scores import alibi_slopes
    # DeprecationWarning: attnlab.scores.alibi_slopes is deprecated and goes away in 1.0: use
    # attnlab.position_bias.alibi_slopes

How an old path keeps working (the decision): each module that had old names defines a module ``__getattr__``
(PEP 562), ``__getattr__ = forward(__name__)``, which Python calls only for a name the module does not bind; it
looks the name up in :data:`MOVED`, warns (``DeprecationWarning``, pointing at the line that read it) and returns
the object, importing its new module then. ``from old.module import name`` goes through it too. A module that is
nothing but old names (:mod:`attnlab.recurrences`, :mod:`attnlab.train`) is that line and an ``__all__`` read from
the table. This was chosen over a module of re-exports that warns once when imported (``from new.module import *``,
as timm's ``timm.models.layers`` does since 0.9) because:

* the table is the one list: an old module binds none of its old names (``tests/test_compat_names.py`` checks it,
  and that no other module hands on a name from elsewhere), so there is no second list to keep in step, and a name
  cannot stay importable by accident once it leaves;
* each name warns on its own, with its own replacement, when it is read (not once per process, at an import that
  may be another library's);
* nothing is imported until an old name is read: this module imports nothing of attnlab when it is imported, so
  the scores do not pay for the decay forms (:mod:`attnlab.train` still imports :mod:`attnlab.training`, as it
  did: that registers training's Hydra resolvers).

The cost: a star import (``from attnlab.scores import *``) brings a module's own names, not its old ones, except
from the modules that are nothing but old names, whose ``__all__`` lists them.

Most entries are the same object under a new path (``new``). Where the call changed (``change`` says how: the
decay and delta-rule functions before 0.7 took ``log_alpha`` and ``beta`` where :mod:`attnlab.transition` takes one
:class:`~attnlab.transition.Transition`; linear attention's took the row-sum normaliser as arguments), the old
path reads the function of this module under the old name, which keeps the old signature on top of ``new``; those
functions go away with the table. Internal code (attnlab, the experiments, the tests that are not about these
names) uses the new names only.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "LAYER_ATTRIBUTES",
    "MOVED",
    "REMOVED_IN",
    "FormAttributes",
    "Moved",
    "chunked_form",
    "effective_matrix",
    "forward",
    "linear_attention_chunked",
    "linear_attention_recurrent",
    "moved_from",
    "old_names",
    "recurrent_form",
    "recurrent_step",
    "rename_old_keys",
    "renamed_state_key",
    "resolve",
    "state_step",
]

REMOVED_IN = "1.0"
"""The version the old names of :data:`MOVED` go away in (each entry may say another)."""


@dataclass(frozen=True)
class Moved:
    """One old name: ``old`` (``module.name``) reads ``new`` (``module.name``), and goes away in ``removed_in``.

    ``change``: empty where the old path is the new object itself; else how a call changes (the old path then reads
    the function of :mod:`attnlab.compat` named as the old one, which keeps the old signature on top of ``new``).
    """

    old: str
    new: str
    removed_in: str = REMOVED_IN
    change: str = ""

    @property
    def module(self) -> str:
        """The old module: ``attnlab.scores`` of ``attnlab.scores.alibi_slopes``."""
        return self.old.rpartition(".")[0]

    @property
    def name(self) -> str:
        """The old name: ``alibi_slopes`` of ``attnlab.scores.alibi_slopes``."""
        return self.old.rpartition(".")[2]

    @property
    def target(self) -> str:
        """The path of the object the old path reads: ``new``, or this module's function of the old name."""
        return f"{__name__}.{self.name}" if self.change else self.new

    def message(self) -> str:
        """The warning's text: what is deprecated, when it goes away, and what to use."""
        use = f"{self.new} ({self.change})" if self.change else self.new
        return f"{self.old} is deprecated and goes away in {self.removed_in}: use {use}"


def _moved(module: str, new_module: str, names: str, removed_in: str = REMOVED_IN) -> tuple[Moved, ...]:
    """The names (space-separated) of ``module`` that are the same objects in ``new_module``."""
    return tuple(Moved(f"{module}.{name}", f"{new_module}.{name}", removed_in) for name in names.split())


_RECORD = "one record in place of log_alpha, beta: Transition(log_alpha, beta)"
_ONES = (
    "the row-sum normaliser as a value column of ones: out = {call} with v1 = cat([v, ones], -1), then "
    "out[..., :D] / (out[..., D:] + eps), as attnlab.forms.linear.LinearForm.{method} does"
)

MOVED: tuple[Moved, ...] = (
    # the decay and delta-rule module before 0.7: the forms moved to attnlab.forms.transitions, their math to
    # attnlab.transition (0.7)
    *_moved(
        "attnlab.recurrences",
        "attnlab.forms.transitions",
        "GLA DeltaNet GatedDeltaNet RetNet TransitionForm retnet_decays",
    ),
    Moved("attnlab.recurrences.state_step", "attnlab.transition.step", change=_RECORD),
    Moved("attnlab.recurrences.recurrent_form", "attnlab.transition.recurrent", change=_RECORD),
    Moved("attnlab.recurrences.chunked_form", "attnlab.transition.chunked", change=_RECORD),
    Moved("attnlab.recurrences.effective_matrix", "attnlab.transition.effective_matrix", change=_RECORD),
    # linear attention's functions beside its backends (0.7: attnlab.forms.linear and attnlab.transition)
    *_moved("attnlab.backends.linear", "attnlab.forms.linear", "linear_attention_global"),
    Moved(
        "attnlab.backends.linear.recurrent_step",
        "attnlab.transition.step",
        change="the state [S z] (B, H, F, D + 1) in place of (S, z): "
        + _ONES.format(call="step(state, phi_q, phi_k, v1)", method="step"),
    ),
    Moved(
        "attnlab.backends.linear.linear_attention_recurrent",
        "attnlab.transition.recurrent",
        change=_ONES.format(call="recurrent(phi_q, phi_k, v1)", method="recurrent"),
    ),
    Moved(
        "attnlab.backends.linear.linear_attention_chunked",
        "attnlab.transition.chunked",
        change=_ONES.format(call="chunked(phi_q, phi_k, v1, None, chunk_size)", method="chunked"),
    ),
    # position biases beside the scores (0.3)
    *_moved(
        "attnlab.scores",
        "attnlab.position_bias",
        "AlibiBias PositionBias ShawBias T5Bias alibi_slopes build_position_bias list_position_biases "
        "register_position_bias t5_relative_bucket",
    ),
    # the statistics under the dashboard (attnlab.stats: training prints intervals too, and never imports the
    # dashboard)
    *_moved(
        "attnlab.dashboard.stats",
        "attnlab.stats",
        "Difference half_width_text holm interval_text mean_ci paired_difference t_critical t_two_sided_p "
        "welch_difference",
    ),
    *_moved("attnlab.dashboard.metrics", "attnlab.stats", "MetricSpec parse_metric plain_number si_number spec_for"),
    *_moved("attnlab.dashboard.load", "attnlab.stats", "finite"),
    *_moved("attnlab.dashboard.tuned", "attnlab.stats", "grid_edges"),
    # the layer's module before the stages and the forms had modules of their own (0.7, 0.8)
    *_moved("attnlab.attention", "attnlab.backends.sdpa", "BiasedSoftmaxAttention scaled_dot_product_attention"),
    *_moved("attnlab.attention", "attnlab.forms.softmax", "DifferentialHeads lambda_init"),
    *_moved("attnlab.attention", "attnlab.masks", "PreparedMask prepare_mask"),
    *_moved("attnlab.attention", "attnlab.stages", "QK_NORMS ShortConvolution config_from_options"),
    Moved(
        "attnlab.attention.LAYER_FIELDS",
        "attnlab.stages.LAYER_STAGES",
        change="a mapping field → the values the layer's stages compute; its keys are the old set",
    ),
    Moved("attnlab.attention.renamed_state_key", "attnlab.compat.renamed_state_key"),
    # the preset verbs beside the config (they are the scores')
    *_moved("attnlab.config", "attnlab.scores", "is_preset list_presets register_preset"),
    # another name for build_task
    Moved("attnlab.tasks.make_task", "attnlab.tasks.build_task"),
    # the training module, before it was a package
    *_moved("attnlab.train", "attnlab.training", "CONF_DIR ConfigError build_module main resolve_d_k run"),
)
"""Every old name, old path → new path, with the version it goes away in."""

_BY_MODULE: dict[str, dict[str, Moved]] = {}
for _entry in MOVED:
    _BY_MODULE.setdefault(_entry.module, {})[_entry.name] = _entry
del _entry


def moved_from(module: str) -> dict[str, Moved]:
    """The old names of ``module`` (``attnlab.scores``): name → its entry (empty for a module without any)."""
    return dict(_BY_MODULE.get(module, {}))


def old_names(module: str) -> list[str]:
    """The old names of ``module``, sorted (the ``__all__`` of a module that is only old names)."""
    return sorted(_BY_MODULE.get(module, {}))


def resolve(path: str) -> Any:
    """The object at ``module.name`` (``attnlab.stats.mean_ci``), importing the module; no warning."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def forward(module: str, otherwise: Callable[[str], Any] | None = None) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``module``: an old name of :data:`MOVED` reads its object with a
    ``DeprecationWarning`` (at the line that read it); any other name is ``otherwise(name)`` (a module's own
    ``__getattr__``, such as lazy imports), or an ``AttributeError`` as without one."""
    entries = _BY_MODULE.get(module, {})

    def __getattr__(name: str) -> Any:
        entry = entries.get(name)
        if entry is None:
            if otherwise is not None:
                return otherwise(name)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(entry.message(), DeprecationWarning, stacklevel=2)
        return resolve(entry.target)

    return __getattr__


# ------------------------------------------------------------------ the old signatures (go away with the table)


def _record(log_alpha: Tensor | None, beta: Tensor | None) -> Any:
    from attnlab.transition import Transition

    return None if log_alpha is None and beta is None else Transition(log_alpha, beta)


def state_step(
    state: Tensor | None, q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor | None = None, beta: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``attnlab.recurrences.state_step`` before 0.7, one token: q, k (B, H, d_k), v (B, H, d_v), log α and β (B, H)
    or None. Use :func:`attnlab.transition.step` with ``Transition(log_alpha, beta)``."""
    from attnlab import transition

    return transition.step(state, q, k, v, _record(log_alpha, beta))


def recurrent_form(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor | None = None, beta: Tensor | None = None
) -> Tensor:
    """``attnlab.recurrences.recurrent_form`` before 0.7, one token at a time. Use
    :func:`attnlab.transition.recurrent` with ``Transition(log_alpha, beta)``."""
    from attnlab import transition

    return transition.recurrent(q, k, v, _record(log_alpha, beta))


def chunked_form(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor | None = None,
    beta: Tensor | None = None,
    chunk_size: int = 64,
) -> Tensor:
    """``attnlab.recurrences.chunked_form`` before 0.7, in chunks. Use :func:`attnlab.transition.chunked` with
    ``Transition(log_alpha, beta)``."""
    from attnlab import transition

    return transition.chunked(q, k, v, _record(log_alpha, beta), chunk_size)


def effective_matrix(q: Tensor, k: Tensor, log_alpha: Tensor | None = None, beta: Tensor | None = None) -> Tensor:
    """``attnlab.recurrences.effective_matrix`` before 0.7, the (L, L) map from v to the output. Use
    :func:`attnlab.transition.effective_matrix` with ``Transition(log_alpha, beta)``."""
    from attnlab import transition

    return transition.effective_matrix(q, k, _record(log_alpha, beta))


def recurrent_step(
    state: tuple[Tensor, Tensor] | None,
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    normalize: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """``attnlab.backends.linear.recurrent_step`` before 0.7, one token of causal linear attention: state
    (S (B, H, F, D), z (B, H, F)) or None (the start), the token's phi_q, phi_k (B, H, F) and v (B, H, D) →
    (out (B, H, D), the new state): S ← S + φ(k) vᵀ, z ← z + φ(k), out = φ(q) S / (φ(q)·z + ε). Use
    :func:`attnlab.transition.step` on v with a column of ones (the state [S z]), as
    :meth:`attnlab.forms.linear.LinearForm.step` does."""
    import torch

    if state is None:
        S = phi_q.new_zeros(*phi_q.shape, v.shape[-1])
        z = phi_q.new_zeros(phi_q.shape)
    else:
        S, z = state
    S = S + phi_k.unsqueeze(-1) * v.unsqueeze(-2)  # (B, H, F, D)
    z = z + phi_k
    out = torch.einsum("bhf,bhfd->bhd", phi_q, S)
    if normalize:
        out = out / ((phi_q * z).sum(-1, keepdim=True) + eps)
    return out, (S, z)


def _with_ones(v: Tensor, normalize: bool) -> Tensor:
    import torch

    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) if normalize else v


def linear_attention_recurrent(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """``attnlab.backends.linear.linear_attention_recurrent`` before 0.7: causal linear attention one token at a time,
    phi_q, phi_k (B, H, L, F), v (B, H, L, D) → (B, H, L, D). Use :func:`attnlab.transition.recurrent` on v with a
    column of ones, as :meth:`attnlab.forms.linear.LinearForm.recurrent` does."""
    from attnlab import transition

    D = v.shape[-1]
    out = transition.recurrent(phi_q, phi_k, _with_ones(v, normalize))
    return out[..., :D] / (out[..., D:] + eps) if normalize else out


def linear_attention_chunked(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, chunk_size: int = 64, normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """``attnlab.backends.linear.linear_attention_chunked`` before 0.7: causal linear attention in chunks of
    ``chunk_size`` tokens, phi_q, phi_k (B, H, L, F), v (B, H, L, D) → (B, H, L, D). Use
    :func:`attnlab.transition.chunked` on v with a column of ones, as :meth:`attnlab.forms.linear.LinearForm.chunked`
    does."""
    from attnlab import transition

    if phi_q.shape[2] == 0:
        return v.new_zeros(*v.shape)
    D = v.shape[-1]
    out = transition.chunked(phi_q, phi_k, _with_ones(v, normalize), None, chunk_size)
    return out[..., :D] / (out[..., D:] + eps) if normalize else out


LAYER_FIELDS = frozenset({"d_k", "d_v", "num_kv_heads", "qk_norm", "rope", "short_conv", "short_conv_residual",
                          "output_gate", "mask", "backend", "backend_params"})  # fmt: skip
"""``attnlab.attention.LAYER_FIELDS`` before 0.8: the fields the layer computes (now
:data:`attnlab.stages.LAYER_STAGES`, a mapping to the values each computes)."""


# ------------------------------------------------------------------ checkpoints of earlier versions

_MOVED_INTO_FORM = ("position_bias.", "normalizer.", "sub_norm.", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def renamed_state_key(key: str, ours: Any) -> str:
    """A checkpoint's state-dict key as this version names it (``ours``: this model's keys). The preset variants'
    bias parameters lived in the score (0.1: ``…score.rel_k``; 0.2: ``…score.position_bias.rel_k``); from 0.3 to
    0.6 they were the layer's position-bias stage (``…position_bias.rel_k``); since 0.7 every stage between the
    projections and the merge is the form's (``…form.position_bias.rel_k``, ``…form.score.…``, a decay or
    delta-rule form's gates ``…form.alpha_gate.…``, which were its score's, differential attention's
    ``…form.lambda_q1`` and ``…form.sub_norm.…``)."""
    if key in ours:
        return key
    dotted = f".{key}"
    candidates = []
    if ".score." in dotted:
        head, _, rest = dotted.rpartition(".score.")
        bias = rest.removeprefix("position_bias.")
        candidates += [f"{head}.position_bias.{bias}", f"{head}.form.position_bias.{bias}"]
        candidates += [f"{head}.form.score.{rest}", f"{head}.form.{rest}"]
    for stage in _MOVED_INTO_FORM:
        if f".{stage}" in dotted:
            head, _, rest = dotted.rpartition(f".{stage}")
            candidates.append(f"{head}.form.{stage}{rest}")
    return next((c.lstrip(".") for c in candidates if c.lstrip(".") in ours), key)


def rename_old_keys(layer: Any, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """The load_state_dict pre-hook of :class:`~attnlab.attention.MultiHeadAttention`: a checkpoint of an earlier
    version loads. The presets' bias parameters move to the position-bias stage (:func:`renamed_state_key`), and the
    stages that moved into the form (0.7: ``score``, ``position_bias``, ``normalizer``, differential attention's λ
    and sub-norm; a decay or delta-rule form's gates, which were its score's) move to ``form.``."""
    ours = {prefix + k for k in layer.state_dict()}
    for key in [k for k in state_dict if k.startswith(prefix) and k not in ours]:
        new = renamed_state_key(key, ours)
        if new != key and new not in state_dict:
            state_dict[new] = state_dict.pop(key)


# ------------------------------------------------------------------ the layer's attributes that are its form's

LAYER_ATTRIBUTES = Moved(
    "attnlab.attention.MultiHeadAttention.<stage>",
    "attnlab.attention.MultiHeadAttention.form.<stage>",
    change="the form's stages and methods (score, position_bias, normalizer, logits …) read through the layer",
)
"""The layer's attribute delegation (before 0.7 the stages were the layer's): ``layer.score`` reads
``layer.form.score``, with a DeprecationWarning, until 1.0."""


class FormAttributes:
    """A mixin of :class:`~attnlab.attention.MultiHeadAttention`: an attribute the layer lacks is read from (and
    one its form has is set on) its form, as before 0.7 (:data:`LAYER_ATTRIBUTES`), with a DeprecationWarning."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # nn.Module's: parameters, buffers, modules
        except AttributeError:
            form = self.__dict__.get("_modules", {}).get("form")
            if form is None or name.startswith("_") or not hasattr(form, name):
                raise
            warnings.warn(
                f"MultiHeadAttention.{name} is deprecated and goes away in {REMOVED_IN}: use .form.{name}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(form, name)

    def __setattr__(self, name: str, value: Any) -> None:
        form = self.__dict__.get("_modules", {}).get("form")
        if form is not None and name not in self.__dict__ and name not in self._modules and hasattr(form, name):
            warnings.warn(
                f"setting MultiHeadAttention.{name} is deprecated and goes away in {REMOVED_IN}: set .form.{name}",
                DeprecationWarning,
                stacklevel=2,
            )
            setattr(form, name, value)
            self.__dict__.pop("_spec", None)  # the layer's record is made again
            return
        super().__setattr__(name, value)
