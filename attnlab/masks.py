"""Attention masks: boolean, True = "may attend", broadcastable to (B, H, Lq, Lk).

In the spirit of FlexAttention's ``mask_mod``, a mask is a function of positions: :meth:`Mask.mask_mod` receives
query positions ``q_idx`` (Lq, 1) and key positions ``kv_idx`` (1, Lk) and returns a bool tensor broadcastable to
(Lq, Lk), or to (B, Lq, Lk) when it also reads per-sequence data (``tokens`` or ``lengths``, for padding).
Masks compose with ``&`` and ``|``. A position-only mask's dense tensor is built once per (Lq, Lk, device) and
cached.

Attention consumes a mask in its prepared form, :class:`PreparedMask`, made here in one pass by
:func:`prepare_mask`: the bool tensor, the same with the rows that see no key opened up (``safe``), which rows see
a key (``visible``), and two facts found once per shape for position-only masks (``is_causal``, ``all_visible``)
that let the fast path pass ``is_causal=True`` to SDPA and skip zeroing rows.

Register a new mask with ``@register_mask("name")`` on a :class:`Mask` subclass or on a plain function
``fn(q_idx, kv_idx, **params) -> bool tensor``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnlab.checks import check_int
from attnlab.registry import BoundedCache, Registry, check_params

__all__ = [
    "AllOf",
    "AnyOf",
    "Causal",
    "KeyPaddedMask",
    "Mask",
    "NoMask",
    "Padding",
    "PreparedMask",
    "SlidingWindow",
    "build_mask",
    "hides_later_keys",
    "list_masks",
    "mask_form",
    "position_part",
    "prepare_mask",
    "register_mask",
    "with_causal",
]


@dataclass(frozen=True, eq=False)
class PreparedMask:
    """A bool mask ready for attention; every tensor broadcastable to (B, H, Lq, Lk).

    Fields:
        allowed: True = may attend.
        safe: ``allowed`` with the rows that see no key opened up entirely, so that a softmax never meets a row of
            −inf; ``hidden`` is ``~safe``.
        visible: (…, Lq, 1), False for the rows that see no key; their weights and output are zeroed.
        is_causal: exactly j ≤ i with Lq = Lk (the fast path then passes ``is_causal=True`` to SDPA).
        all_visible: every row sees a key (the fast path then skips zeroing rows). Both facts are found only for
            position-only masks, once per shape; for a per-batch mask they are False (no host sync per step).
        derived: tensors derived from this mask and cached with it (the fast path's masked position biases).
        structure: what the mask is made of, for the O(L) backends of linear attention: ``causal`` (exactly
            j ≤ i, with or without ``keys``), ``none`` (only ``keys``), or ``dense`` (anything else).
        keys: (B, 1, 1, Lk) the key-padding part (True = a real key) when the mask is ``structure`` AND it; else
            None. The O(L) backends hide such keys by zeroing their features.
    """

    allowed: Tensor
    safe: Tensor
    visible: Tensor
    is_causal: bool = False
    all_visible: bool = False
    hidden: Tensor = field(init=False, repr=False)
    derived: BoundedCache = field(default_factory=BoundedCache, repr=False)
    structure: str = "dense"
    keys: Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", ~self.safe)
        if self.structure == "dense" and self.is_causal:
            object.__setattr__(self, "structure", "causal")
        elif self.structure == "dense" and self.allowed.shape[-2] == 1 and self.allowed.shape[1] == 1:
            object.__setattr__(self, "structure", "none")  # a key mask (B, 1, 1, Lk): padding
            object.__setattr__(self, "keys", self.allowed)

    @property
    def form(self) -> str:
        """``causal``, ``causal+padding``, ``padding`` or ``other``: the mask as the O(L) backends see it."""
        if self.structure == "causal":
            return "causal" if self.keys is None else "causal+padding"
        return "padding" if self.structure == "none" else "other"

    def with_key_padding(self, keys: Tensor) -> PreparedMask:
        """This mask AND the key padding ``keys`` (B, 1, 1, Lk), prepared. A causal mask keeps its parts
        (``structure``, ``keys``), so that the O(L) backends compute it from them, and its dense (B, 1, Lq, Lk)
        tensors are made only when a consumer reads them (:class:`KeyPaddedMask`); any other is combined now."""
        if self.structure == "causal":
            return KeyPaddedMask(self, keys)
        return PreparedMask.from_tensor(self.allowed & keys)

    @classmethod
    def from_tensor(cls, allowed: Tensor, find_facts: bool = False) -> PreparedMask:
        """Prepare a bool tensor (True = may attend). ``find_facts``: also find ``is_causal`` and ``all_visible``
        (one host sync; done for cached masks only)."""
        if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
            raise TypeError(
                f"mask must be a bool tensor (True = may attend), an attnlab Mask or None, got "
                f"{allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__}"
            )
        while allowed.dim() < 4:
            allowed = allowed.unsqueeze(0)
        visible = allowed.any(dim=-1, keepdim=True)  # (…, Lq, 1)
        causal = all_visible = False
        if find_facts:
            lq, lk = allowed.shape[-2:]
            tril = torch.ones(lq, lk, dtype=torch.bool, device=allowed.device).tril()
            causal = lq == lk and allowed.shape[:2] == (1, 1) and torch.equal(allowed[0, 0], tril)
            all_visible = bool(visible.all())
        return cls(allowed, allowed | ~visible, visible, is_causal=causal, all_visible=all_visible)


class KeyPaddedMask(PreparedMask):
    """A causal mask AND key padding (B, 1, 1, Lk): ``structure`` ``causal``, ``keys`` the padding. The O(L)
    backends read only these; ``allowed``, ``safe``, ``visible`` and ``hidden`` (B, 1, Lq, Lk) are computed on
    first use (the eager path, SDPA) and kept."""

    def __init__(self, base: PreparedMask, keys: Tensor) -> None:  # (not the dataclass's: nothing dense yet)
        for name, value in (
            ("is_causal", False),
            ("all_visible", False),
            ("derived", BoundedCache()),
            ("structure", "causal"),
            ("keys", keys),
            ("base", base),
        ):
            object.__setattr__(self, name, value)

    @functools.cached_property
    def allowed(self) -> Tensor:  # type: ignore[override]
        return self.base.allowed & self.keys

    @functools.cached_property
    def visible(self) -> Tensor:  # type: ignore[override]
        return self.allowed.any(dim=-1, keepdim=True)

    @functools.cached_property
    def safe(self) -> Tensor:  # type: ignore[override]
        return self.allowed | ~self.visible

    @functools.cached_property
    def hidden(self) -> Tensor:  # type: ignore[override]
        return ~self.safe

    def __repr__(self) -> str:
        return f"KeyPaddedMask(causal, keys={tuple(self.keys.shape)})"


def prepare_mask(
    mask: Tensor | Mask | PreparedMask | None,
    num_queries: int,
    num_keys: int,
    device: torch.device | str | None = None,
    *,
    tokens: Tensor | None = None,
    lengths: Tensor | None = None,
) -> PreparedMask | None:
    """Turn a bool tensor (True = may attend) or a :class:`Mask` into a :class:`PreparedMask` (None: no masking).

    A position-only Mask's PreparedMask is built once per (Lq, Lk, device) and cached on the mask (treat it as
    read-only); a mask that reads ``tokens`` / ``lengths`` is prepared from them each call."""
    if mask is None or isinstance(mask, PreparedMask):
        return mask
    if isinstance(mask, Mask):
        return mask.prepare(num_queries, num_keys, device, tokens=tokens, lengths=lengths)
    return PreparedMask.from_tensor(mask)


class Mask:
    """Base class. Subclasses implement :meth:`mask_mod`; set ``position_only = False`` if it reads
    ``tokens`` / ``lengths``. Override :attr:`is_causal` to return True for a mask that is exactly j ≤ i (the
    encoder then picks causal variants, e.g. T5's one-directional buckets). Whatever it says, a position-only mask
    whose tensor equals j ≤ i is found to be causal when prepared, and gets SDPA's ``is_causal``."""

    position_only: bool = True

    @property
    def is_causal(self) -> bool:
        """The mask is exactly "key j is visible from query i iff j ≤ i"."""
        return False

    def _cache(self) -> BoundedCache:
        """Dense and prepared forms of a position-only mask, per (Lq, Lk, device); made on first use, so that a
        subclass need not call ``super().__init__()``."""
        return self.__dict__.setdefault("_derived", BoundedCache())

    def mask_mod(self, q_idx: Tensor, kv_idx: Tensor, tokens: Tensor | None, lengths: Tensor | None) -> Tensor:
        """q_idx (Lq, 1), kv_idx (1, Lk) long → bool broadcastable to (Lq, Lk) or (B, Lq, Lk)."""
        raise NotImplementedError

    def dense(
        self,
        num_queries: int,
        num_keys: int,
        device: torch.device | str | None = None,
        *,
        tokens: Tensor | None = None,
        lengths: Tensor | None = None,
    ) -> Tensor:
        """The mask in its smallest broadcastable 4-D shape: (B or 1, 1, Lq or 1, Lk). Cached if position-only, so
        treat it as read-only (``materialize`` returns a copy)."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        if self.position_only:
            return self._cache().get_or_make(
                ("dense", num_queries, num_keys, device),
                lambda: self._evaluate(num_queries, num_keys, device, None, None),
            )
        return self._evaluate(num_queries, num_keys, device, tokens, lengths)

    def prepare(
        self,
        num_queries: int,
        num_keys: int,
        device: torch.device | str | None = None,
        *,
        tokens: Tensor | None = None,
        lengths: Tensor | None = None,
    ) -> PreparedMask | None:
        """The :class:`PreparedMask` for these sizes (None when the mask is trivial); cached when position-only,
        with its facts (``is_causal``, ``all_visible``) found once."""
        if self.is_trivial:
            return None
        device = torch.device(device) if device is not None else torch.device("cpu")
        if not self.position_only:
            return PreparedMask.from_tensor(self.dense(num_queries, num_keys, device, tokens=tokens, lengths=lengths))

        return self._cache().get_or_make(
            ("prepared", num_queries, num_keys, device),
            lambda: PreparedMask.from_tensor(self.dense(num_queries, num_keys, device), find_facts=True),
        )

    def materialize(
        self,
        num_queries: int,
        num_keys: int,
        device: torch.device | str | None = None,
        *,
        tokens: Tensor | None = None,
        lengths: Tensor | None = None,
    ) -> Tensor:
        """The full mask (B or 1, 1, Lq, Lk), bool, True = may attend (a fresh tensor, safe to modify)."""
        m = self.dense(num_queries, num_keys, device, tokens=tokens, lengths=lengths)
        return m.expand(m.shape[0], 1, num_queries, num_keys).clone()

    def _evaluate(
        self,
        num_queries: int,
        num_keys: int,
        device: torch.device,
        tokens: Tensor | None,
        lengths: Tensor | None,
    ) -> Tensor:
        q_idx = torch.arange(num_queries, device=device)[:, None]
        kv_idx = torch.arange(num_keys, device=device)[None, :]
        m = torch.as_tensor(self.mask_mod(q_idx, kv_idx, tokens, lengths), device=device).bool()
        while m.dim() < 3:
            m = m.unsqueeze(0)
        return m.unsqueeze(1)  # (B|1, 1, Lq|1, Lk|1)

    def __and__(self, other: Mask) -> Mask:
        return AllOf([self, other])

    def __or__(self, other: Mask) -> Mask:
        return AnyOf([self, other])

    @property
    def is_trivial(self) -> bool:
        """True when the mask lets every query see every key (no masking work needed)."""
        return False

    def __repr__(self) -> str:
        params = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in params.items())})"


# --------------------------------------------------------------------------------------------- registry


def _wrap_mask(name: str, obj: Any, kwargs: dict[str, Any]) -> Mask:
    check_params("mask", name, obj, kwargs, ("q_idx", "kv_idx"))
    if isinstance(obj, type) and issubclass(obj, Mask):
        return obj(**kwargs)
    return FunctionMask(name, obj, **kwargs)


_MASKS: Registry[Mask] = Registry("mask", _wrap_mask)


def register_mask(name: str) -> Callable[[Any], Any]:
    """Decorator registering a :class:`Mask` subclass or a position function ``fn(q_idx, kv_idx, **params)``."""
    return _MASKS.register(name)


def build_mask(name: str | Mask | dict[str, Any], **params: Any) -> Mask:
    """Build a mask by name (``build_mask("sliding_window", window=4)``), or from a spec dict
    ``{"name": ..., **params}``; a :class:`Mask` is returned as is."""
    if isinstance(name, Mask):
        return name
    if isinstance(name, dict) or hasattr(name, "items"):
        spec = dict(name.items())
        if "name" not in spec:
            raise ValueError(f"a mask spec needs a 'name' key, got {spec}")
        return _MASKS.build(spec.pop("name"), **spec, **params)
    return _MASKS.build(name, **params)


def list_masks() -> list[str]:
    """Names of the registered masks."""
    return _MASKS.names()


class FunctionMask(Mask):
    """A registered position function ``fn(q_idx, kv_idx, **params)``."""

    def __init__(self, name: str, fn: Callable[..., Tensor], **params: Any) -> None:
        self.name, self.fn, self.params = name, fn, params

    def mask_mod(self, q_idx: Tensor, kv_idx: Tensor, tokens: Tensor | None, lengths: Tensor | None) -> Tensor:
        return self.fn(q_idx, kv_idx, **self.params)

    def __repr__(self) -> str:
        return f"{self.name}({self.params})"


# --------------------------------------------------------------------------------------------- masks


@register_mask("none")
class NoMask(Mask):
    """Every query sees every key."""

    def mask_mod(self, q_idx: Tensor, kv_idx: Tensor, tokens: Tensor | None, lengths: Tensor | None) -> Tensor:
        return (q_idx >= 0) & (kv_idx >= 0)

    @property
    def is_trivial(self) -> bool:
        return True


@register_mask("causal")
class Causal(Mask):
    """Key j is visible from query i iff j ≤ i."""

    def mask_mod(self, q_idx: Tensor, kv_idx: Tensor, tokens: Tensor | None, lengths: Tensor | None) -> Tensor:
        return kv_idx <= q_idx

    @property
    def is_causal(self) -> bool:
        return True


@register_mask("sliding_window")
class SlidingWindow(Mask):
    """Key j is visible from query i iff |i − j| < window (symmetric; ``window=1`` is the token itself).

    Compose with :class:`Causal` for the one-sided window i − window < j ≤ i (Mistral-style).
    """

    def __init__(self, window: int) -> None:
        self.window = check_int("window", window, minimum=1)

    def mask_mod(self, q_idx: Tensor, kv_idx: Tensor, tokens: Tensor | None, lengths: Tensor | None) -> Tensor:
        return (q_idx - kv_idx).abs() < self.window


@register_mask("padding")
class Padding(Mask):
    """Hides padded keys: key j of sequence b is hidden if ``tokens[b, j] == pad_id`` (given ``tokens`` (B, Lk)
    and a ``pad_id``) or if ``j >= lengths[b]`` (given ``lengths`` (B,)); both apply when both are given. Query
    rows are not masked: a pad query still sees the real keys."""

    position_only = False

    def __init__(self, pad_id: int | None = 0) -> None:
        self.pad_id = pad_id

    def mask_mod(self, q_idx: Tensor, kv_idx: Tensor, tokens: Tensor | None, lengths: Tensor | None) -> Tensor:
        use_tokens = tokens is not None and self.pad_id is not None
        if not use_tokens and lengths is None:
            raise ValueError("the padding mask needs tokens= (with a pad_id) or lengths= to find the padded keys")
        visible = torch.ones_like(kv_idx, dtype=torch.bool)[None]  # (1, 1, Lk)
        if lengths is not None:
            visible = visible & (kv_idx[None] < lengths.to(kv_idx.device).view(-1, 1, 1))  # (B, 1, Lk)
        if use_tokens:
            if tokens.shape[-1] != kv_idx.shape[-1]:
                raise ValueError(f"padding mask: tokens have length {tokens.shape[-1]}, keys {kv_idx.shape[-1]}")
            visible = visible & (tokens != self.pad_id)[:, None, :]  # (B, 1, Lk)
        return visible


class _Composite(Mask):
    def __init__(self, masks: Sequence[Mask | str | dict[str, Any]]) -> None:
        if not masks:
            raise ValueError(f"'{self._verb}' needs at least one mask")
        self.masks = [build_mask(m) for m in masks]
        self.position_only = all(m.position_only for m in self.masks)

    _verb = ""

    def __repr__(self) -> str:
        return f" {'&' if self._verb == 'and' else '|'} ".join(f"({m!r})" for m in self.masks)


@register_mask("and")
class AllOf(_Composite):
    """Visible iff visible under every mask (``m1 & m2``)."""

    _verb = "and"

    def mask_mod(self, q_idx: Tensor, kv_idx: Tensor, tokens: Tensor | None, lengths: Tensor | None) -> Tensor:
        out = self.masks[0].mask_mod(q_idx, kv_idx, tokens, lengths)
        for m in self.masks[1:]:
            out = out & m.mask_mod(q_idx, kv_idx, tokens, lengths)
        return out

    @property
    def is_trivial(self) -> bool:
        return all(m.is_trivial for m in self.masks)

    @property
    def is_causal(self) -> bool:
        """Causal when one part is and every other part is causal or lets everything through."""
        return any(m.is_causal for m in self.masks) and all(m.is_causal or m.is_trivial for m in self.masks)


@register_mask("or")
class AnyOf(_Composite):
    """Visible iff visible under at least one mask (``m1 | m2``)."""

    _verb = "or"

    def mask_mod(self, q_idx: Tensor, kv_idx: Tensor, tokens: Tensor | None, lengths: Tensor | None) -> Tensor:
        out = self.masks[0].mask_mod(q_idx, kv_idx, tokens, lengths)
        for m in self.masks[1:]:
            out = out | m.mask_mod(q_idx, kv_idx, tokens, lengths)
        return out

    @property
    def is_trivial(self) -> bool:
        return any(m.is_trivial for m in self.masks)

    @property
    def is_causal(self) -> bool:
        return all(m.is_causal for m in self.masks)


def mask_form(mask: Mask | None) -> str:
    """What a (structural) mask is, as the O(L) backends see it: ``none`` (every key visible), ``causal``,
    ``padding`` (key padding only), ``causal+padding``, or ``other``."""
    if mask is None or mask.is_trivial:
        return "none"
    if mask.is_causal:
        return "causal"
    if isinstance(mask, Padding):
        return "padding"
    if isinstance(mask, AllOf):
        forms = {mask_form(m) for m in mask.masks} - {"none"}
        if forms <= {"padding"}:
            return "padding"
        if forms <= {"causal", "padding", "causal+padding"} and any(f.startswith("causal") for f in forms):
            return "causal+padding" if forms & {"padding", "causal+padding"} else "causal"
    return "other"


def hides_later_keys(mask: Mask) -> bool:
    """Whether every key after the query is hidden: a causal mask, or a position-only one (causal & window) whose
    64 × 64 tensor has nothing above the diagonal. Decides T5's one-directional buckets."""
    if mask.is_causal:
        return True
    if mask.is_trivial or not mask.position_only:
        return False
    return not bool(mask.dense(64, 64)[0, 0].triu(1).any())


_CAUSAL = build_mask("causal")


def position_part(mask: Mask | None) -> Mask | None:
    """The part of ``mask`` that reads positions only (``causal & padding`` → ``causal``; key padding, which
    needs the tokens, → None): what a layer applies to a call that passes no mask."""
    if mask is None or mask.position_only:
        return mask
    if isinstance(mask, AllOf):
        parts = [m for m in mask.masks if m.position_only]
        return None if not parts else functools.reduce(operator.and_, parts)
    return None


def with_causal(mask: PreparedMask | None, num_queries: int, num_keys: int, device: torch.device) -> PreparedMask:
    """A call's prepared mask AND causal (query i sees the keys j ≤ i), for a self-attention form that is causal by
    construction (forgetting attention, multi-token attention): as it is when it is causal already (``causal``,
    ``causal+padding``), the cached causal mask for None, else combined."""
    if mask is not None and mask.form in ("causal", "causal+padding"):
        return mask
    causal = _CAUSAL.prepare(num_queries, num_keys, device)
    return causal if mask is None else PreparedMask.from_tensor(mask.allowed & causal.allowed)
