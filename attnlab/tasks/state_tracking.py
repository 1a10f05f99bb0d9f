"""State-tracking tasks: the running product of a sequence of group elements, labelled at every position.

Merrill et al. 2024 ("The Illusion of State in State-Space Models", arXiv 2404.08819) and Grazzi et al. 2025
("Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues", arXiv 2411.12537) measure what a sequence
model can *track*: given elements ``g_1 … g_T`` of a finite group, the state after ``t`` tokens is
``s_t = g_t · s_{t-1}`` (``s_0`` the identity), and the model must output ``s_t`` at every ``t``. Three groups, from
easy to hard:

* :class:`Parity` (``task=parity``): bits, the running parity (the cyclic group Z_2). A linear RNN whose transition
  has eigenvalues in [0, 1] cannot represent it at every length (Grazzi et al., Theorem 1); eigenvalues in [−1, 1]
  can (β ∈ (0, 2) in DeltaNet).
* :class:`Modular` (``task=modular``): numbers 0 … m − 1, the running sum mod m (Z_m, m = 3 or 5 in the papers):
  "mod-m counting", which needs complex (rotation) eigenvalues in one layer, or several layers of reflections.
* :class:`Permutation` (``task=permutation``): elements of the symmetric group S_n (``group=S5``, Merrill et al.'s
  hard case; S3, S4 and the alternating groups A3–A5 too). S5 is not solvable, so by Barrington's theorem tracking
  it is NC¹-complete: no fixed-depth transformer or diagonal linear RNN does it at every length (Merrill et al.);
  a product of n_h ≥ 2 Householder reflections a token can (DeltaProduct, Siems et al. 2025).

**Tokens and labels.** Element ``e`` of the group (its index in :attr:`GroupTask.elements`) is token ``e + 1``
(0 is PAD and never occurs in a sequence); the label at position ``t`` is the index of ``s_t``, so
``num_classes = vocab_size − 1 = |G|``. Elements are drawn i.i.d. uniformly, so after the first token the state is
uniform over the group. Every position has a label (no padding in any split).

**Lengths.** Training, validation and test sequences have exactly ``seq_len`` tokens. ``test_lengths=[64, 128]``
adds test sets of longer sequences (length generalisation, the claim these papers test); by default
(``length_labels="beyond"``) only the positions at or after ``seq_len`` are labelled there, so ``test/acc@L`` is the
accuracy on states the model never had to produce in training. ``length_labels="all"`` labels every position.
With test lengths, a task's headline metric (:meth:`GroupTask.headline_length`: what the dashboard and the results
table lead with) is ``test/acc`` at the longest of them.

**Chance.** A model that tracks nothing can still copy the first token (``s_1 = g_1``) and guess after it: its
accuracy is ``(1 + (T − 1)/|G|) / T`` on ``T`` labelled positions (:attr:`chance_accuracy`; exactly ``1/|G|`` on
a ``"beyond"`` test set).

**Composition convention.** Permutations act on ``{0, …, n−1}``; an element is the tuple ``p`` with ``p[i]`` the
image of ``i``, and ``(g · s)[i] = g[s[i]]`` (``g`` applied after ``s``). The elements are listed in
``itertools.permutations`` order (lexicographic; the identity first). For Z_m the element ``e`` is the residue
``e`` and ``g · s = (g + s) mod m``.
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import numpy as np

from attnlab.checks import check_choice, check_int
from attnlab.tasks import register_task
from attnlab.tasks.base import IGNORE_INDEX, DataOptions, SequenceTask

__all__ = ["GroupTask", "Modular", "Parity", "Permutation", "cyclic_table", "group_elements"]

LENGTH_LABELS: tuple[str, ...] = ("beyond", "all")
"""What a ``test_lengths`` set labels: only the positions at or after ``seq_len`` (``beyond``), or every one."""

GROUPS: tuple[str, ...] = ("S2", "S3", "S4", "S5", "A3", "A4", "A5")
"""The permutation groups :class:`Permutation` takes (S_n: every permutation of n items; A_n: the even ones)."""


def _is_even(perm: tuple[int, ...]) -> bool:
    inversions = sum(1 for i in range(len(perm)) for j in range(i + 1, len(perm)) if perm[i] > perm[j])
    return inversions % 2 == 0


def group_elements(group: str) -> list[tuple[int, ...]]:
    """The elements of ``group`` (``"S5"``, ``"A4"``, ...) as permutation tuples in ``itertools.permutations``
    order (the identity first): S_n has n! of them, A_n n!/2."""
    check_choice("group", group, GROUPS)
    n = int(group[1:])
    perms = list(itertools.permutations(range(n)))
    return perms if group[0] == "S" else [p for p in perms if _is_even(p)]


class GroupTask(SequenceTask):
    """Common part of the state-tracking tasks (per-token labels): the running product of i.i.d. uniform group
    elements (see the module docstring).

    A subclass sets :attr:`order` (|G|) and :attr:`table` (``table[g, s]`` = the index of ``g · s``) in its
    ``__init__`` before calling :meth:`_finish`.

    Args:
        seq_len: tokens per training (validation, test) sequence, ``>= 1``.
        length_labels: ``"beyond"`` (default) or ``"all"``: which positions a ``test_lengths`` set labels.
        **data: batch_size, num_train (default 10,000), num_val, num_test (1,000 each), seed, num_workers,
            resample, test_lengths (each ``> seq_len`` under ``"beyond"``): see
            :class:`~attnlab.tasks.base.DataOptions`.

    Batches: ``tokens LongTensor (B, L)`` in ``[1, |G|]``, ``labels LongTensor (B, L)`` in ``[0, |G|)`` (or -100
    before ``seq_len`` in a ``"beyond"`` length-test set).
    """

    per_token = True
    data_defaults: ClassVar[DataOptions] = DataOptions(num_train=10_000, num_val=1_000, num_test=1_000)
    length_keys = ("seq_len",)
    order: int
    table: np.ndarray

    def __init__(self, seq_len: int = 32, length_labels: str = "beyond", **data: Any) -> None:
        super().__init__(**data)
        self.seq_len = check_int("seq_len", seq_len, minimum=1)
        self.max_len = self.seq_len
        self.length_labels = check_choice("length_labels", length_labels, LENGTH_LABELS)

    @classmethod
    def headline_length(cls, test_lengths: tuple[int, ...], **options: Any) -> int | None:
        """The longest test length: the claim these tasks test is tracking the state beyond the training length,
        so ``test/acc@<longest>`` is their headline (:meth:`SequenceTask.headline_metric`)."""
        return max(test_lengths)

    def _finish(self) -> None:
        self.vocab_size = self.order + 1
        self.num_classes = self.order
        self.chance_accuracy = self.copy_first_accuracy(self.seq_len)
        self.check_test_lengths()

    def copy_first_accuracy(self, length: int, start: int = 0) -> float:
        """Accuracy of copying the first token and guessing uniformly elsewhere, on the positions ``start ≤ t <
        length`` of a sequence of ``length`` tokens (the best a model that tracks nothing does)."""
        labelled = length - start
        first = 1.0 if start == 0 else 0.0
        return (first + (labelled - first) / self.order) / labelled

    def check_length(self, length: int, name: str = "test_lengths") -> None:
        """Under ``length_labels="beyond"`` a test length must exceed ``seq_len`` (else it labels nothing)."""
        if self.length_labels == "beyond" and length <= self.seq_len:
            raise ValueError(
                f"{name} must be > seq_len = {self.seq_len} with length_labels=beyond (only the positions beyond the "
                f"training length are labelled), got {length}; set length_labels=all to label every position"
            )

    def running_states(self, elements: np.ndarray) -> np.ndarray:
        """``(N, T)`` element indices → ``(N, T)`` state indices ``s_t = g_t · s_{t-1}`` (``s_1 = g_1``)."""
        states = np.empty_like(elements)
        state = elements[:, 0]
        states[:, 0] = state
        for t in range(1, elements.shape[1]):
            state = self.table[elements[:, t], state]
            states[:, t] = state
        return states

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` sequences of ``seq_len`` tokens: tokens ``(num, seq_len)``, labels ``(num, seq_len)``."""
        elements = rng.integers(0, self.order, size=(num, self.seq_len))
        return elements + 1, self.running_states(elements)

    def generate_length(self, num: int, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``num`` sequences of ``length`` tokens; under ``"beyond"`` the labels before ``seq_len`` are -100."""
        elements = rng.integers(0, self.order, size=(num, length))
        labels = self.running_states(elements)
        if self.length_labels == "beyond":
            labels[:, : self.seq_len] = IGNORE_INDEX
        return elements + 1, labels


def cyclic_table(modulus: int) -> np.ndarray:
    """Z_m's product table: ``table[g, s] = (g + s) mod m``."""
    residues = np.arange(modulus)
    return (residues[:, None] + residues[None, :]) % modulus


@register_task("modular")
class Modular(GroupTask):
    """Running sum mod ``modulus`` (the cyclic group Z_m; Grazzi et al. 2025's "modular arithmetic" without the
    operators, Merrill et al.'s mod-m counting): tokens are the residues 0 … m − 1 (ids 1 … m), the label at ``t`` is
    ``(x_1 + … + x_t) mod m``.

    Args:
        modulus: m ``>= 2`` (3 and 5 in the papers; 2 is :class:`Parity`).
        seq_len, length_labels, **data: see :class:`GroupTask`.
    """

    def __init__(self, modulus: int = 3, seq_len: int = 32, length_labels: str = "beyond", **data: Any) -> None:
        super().__init__(seq_len=seq_len, length_labels=length_labels, **data)
        self.modulus = check_int("modulus", modulus, minimum=2, maximum=1024)
        self.order = self.modulus
        self.table = cyclic_table(self.modulus)
        self._finish()

    def _describe_details(self) -> str:
        return f"modulus={self.modulus}, length_labels={self.length_labels}"


@register_task("parity")
class Parity(GroupTask):
    """Running parity of a bit string (Z_2): tokens are bits (0 → id 1, 1 → id 2), the label at ``t`` is
    ``(b_1 + … + b_t) mod 2``. The test Grazzi et al. 2025 use for negative eigenvalues.

    Args:
        seq_len, length_labels, **data: see :class:`GroupTask`.
    """

    def __init__(self, seq_len: int = 32, length_labels: str = "beyond", **data: Any) -> None:
        super().__init__(seq_len=seq_len, length_labels=length_labels, **data)
        self.order = 2
        self.table = cyclic_table(2)
        self._finish()

    def _describe_details(self) -> str:
        return f"length_labels={self.length_labels}"


@register_task("permutation")
class Permutation(GroupTask):
    """Running composition of permutations (Merrill et al. 2024's word problem for S_n; the alternating groups
    A_n too): the tokens are the group's elements (``group_elements(group)``, ids 1 … |G|), the label at ``t`` the
    index of ``g_t ∘ … ∘ g_1``.

    S3 (6 elements) is solvable and small; S5 (120 elements, the default) and A5 (60) are not solvable, the
    papers' hard case.

    Args:
        group: one of ``S2, S3, S4, S5, A3, A4, A5``.
        seq_len, length_labels, **data: see :class:`GroupTask`.
    """

    def __init__(self, group: str = "S5", seq_len: int = 32, length_labels: str = "beyond", **data: Any) -> None:
        super().__init__(seq_len=seq_len, length_labels=length_labels, **data)
        self.group = check_choice("group", group, GROUPS)
        self.elements = group_elements(self.group)
        index = {p: i for i, p in enumerate(self.elements)}
        self.order = len(self.elements)
        self.table = np.array(
            [[index[tuple(g[s[i]] for i in range(len(g)))] for s in self.elements] for g in self.elements]
        )
        self._finish()

    def _describe_details(self) -> str:
        return f"group={self.group} ({self.order} elements), length_labels={self.length_labels}"
