"""ListOps (Nangia & Bowman, 2018) with the Long Range Arena grammar (Tay et al., 2021).

An expression is a tree of list operators over the digits 0-9, written in prefix form with brackets,
for example ``[MAX 2 9 [MIN 4 7 ] 0 ]`` (value 9). The operators are those of LRA:

* ``[MIN`` / ``[MAX``: smallest / largest argument.
* ``[MED``: median as LRA computes it, ``int(np.median(args))``: for an even number of arguments, the mean
  of the two middle values, truncated towards zero (``[MED 1 2 ]`` → 1, ``[MED 3 8 4 1 ]`` → 3).
* ``[SM``: sum modulo 10.

The label of a sequence is the value of its expression (10 classes). The brackets make the task
order-sensitive: moving a digit into another bracket changes the value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any, Union

import numpy as np
import torch

from attnlab.checks import check_int, check_prob
from attnlab.tasks import register_task
from attnlab.tasks.base import PAD_ID, DataOptions, SequenceTask, pad_sequences

MIN, MAX, MED, SUM_MOD, END = "[MIN", "[MAX", "[MED", "[SM", "]"
OPERATORS: tuple[str, ...] = (MIN, MAX, MED, SUM_MOD)
"""LRA's operator set (``FIRST``/``LAST`` of the original generator are not used by LRA either)."""

#: Token ids: PAD=0, digit d → d + 1 (1..10), then the operators (11..14) and the closing bracket (15).
DIGIT_OFFSET: int = 1
TOKEN_IDS: dict[str, int] = {
    **{str(d): d + DIGIT_OFFSET for d in range(10)},
    MIN: 11,
    MAX: 12,
    MED: 13,
    SUM_MOD: 14,
    END: 15,
}
ID_TO_TOKEN: dict[int, str] = {i: s for s, i in TOKEN_IDS.items()}
VOCAB_SIZE: int = 16

ListOpsTree = Union[int, tuple[str, list["ListOpsTree"]]]  # noqa: UP007 (recursive alias, runtime-safe)
"""A leaf digit ``0..9`` or ``(operator, [arguments...])`` with ``operator`` in :data:`OPERATORS`."""


def evaluate(tree: ListOpsTree) -> int:
    """Value ``0..9`` of an expression tree (LRA semantics; see the module docstring for ``[MED``)."""
    if isinstance(tree, (int, np.integer)):
        return int(tree)
    op, args = tree
    values = [evaluate(arg) for arg in args]
    if op == MIN:
        return min(values)
    if op == MAX:
        return max(values)
    if op == MED:  # == int(np.median(values)): the two middle values' mean, truncated (values are >= 0)
        values.sort()
        middle = len(values) // 2
        return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) // 2
    if op == SUM_MOD:
        return sum(values) % 10
    raise ValueError(f"unknown ListOps operator {op!r}; expected one of {', '.join(OPERATORS)}")


def to_tokens(tree: ListOpsTree) -> list[int]:
    """Token ids of an expression in prefix form: ``(op, [a, b])`` → ``[op, a, b, ]``; no padding."""
    out: list[int] = []

    def visit(node: ListOpsTree) -> None:
        if isinstance(node, (int, np.integer)):
            out.append(int(node) + DIGIT_OFFSET)
            return
        op, args = node
        out.append(TOKEN_IDS[op])
        for arg in args:
            visit(arg)
        out.append(TOKEN_IDS[END])

    visit(tree)
    return out


def detokenize(tokens: Iterable[int] | torch.Tensor | np.ndarray) -> str:
    """Space-separated text of a token sequence ``(L,)``, PAD skipped: e.g. ``"[MAX 2 9 [MIN 4 7 ] 0 ]"``."""
    if isinstance(tokens, (torch.Tensor, np.ndarray)):
        tokens = tokens.tolist()
    return " ".join(ID_TO_TOKEN[int(t)] for t in tokens if int(t) != PAD_ID)


def max_tree_length(max_depth: int, max_args: int) -> int:
    """Longest token count of a tree with ``max_depth`` operator levels and ``max_args`` arguments."""
    length = 1
    for _ in range(max_depth):
        length = 2 + max_args * length
    return length


class TreeTooLongError(Exception):
    """Raised inside the sampler to abandon a tree as soon as it exceeds the length budget."""


def uniform_stream(rng: np.random.Generator, block: int = 8192) -> Callable[[], float]:
    """A function returning ``rng``'s next uniform [0, 1) number, drawn in blocks (scalar calls are slow)."""

    def stream() -> Iterator[float]:
        while True:
            yield from rng.random(block).tolist()

    return stream().__next__


def sample_tree(
    draw: Callable[[], float], max_depth: int, max_args: int, leaf_prob: float, max_length: int
) -> ListOpsTree:
    """Sample one tree like LRA's ``generate_tree``, consuming uniforms from ``draw``.

    The root is always an operator. Below it, a node at operator depth ``d`` (root: 0) is a digit with
    probability ``leaf_prob`` and always a digit when ``d == max_depth``; an operator takes a uniform number
    of arguments in ``[2, max_args]`` and a uniform operator; digits are uniform in 0..9. Raises
    ``TreeTooLongError`` as soon as the tree passes ``max_length`` tokens.
    """
    length = 0
    num_ops = len(OPERATORS)

    def node(depth: int) -> ListOpsTree:
        nonlocal length
        if depth > 0 and (depth >= max_depth or draw() < leaf_prob):
            length += 1
            if length > max_length:
                raise TreeTooLongError
            return int(draw() * 10)
        length += 2
        if length > max_length:
            raise TreeTooLongError
        num_args = 2 + int(draw() * (max_args - 1))
        op = OPERATORS[int(draw() * num_ops)]
        return (op, [node(depth + 1) for _ in range(num_args)])

    return node(0)


@register_task("listops")
class ListOps(SequenceTask):
    """ListOps data module (per-sequence labels, 10 classes).

    Tokens: PAD=0, digits 0..9 → 1..10, ``[MIN``=11, ``[MAX``=12, ``[MED``=13, ``[SM``=14, ``]``=15
    (``vocab_size = 16``). Helpers: :func:`evaluate`, :func:`to_tokens`, :func:`detokenize` (also
    available as static methods).

    Generation follows LRA's generator with two documented differences: the root is always an operator
    (LRA's root may be a bare digit, which its ``min_length`` filter then drops), and ``max_depth`` counts
    operator levels (LRA's ``max_depth=d`` allows ``d - 1`` nested operators). A tree whose token count is
    outside ``[min_length, max_length]`` (both inclusive) is rejected and a new one drawn; examples are not
    de-duplicated (short expressions recur, also across splits).

    The train and validation splits use ``max_depth``, ``max_args``, ``min_length``, ``max_length``; the
    test split uses the ``test_*`` values (defaulting to the train ones), so it can hold longer sequences
    for length generalisation: e.g. ``test_min_length=65, test_max_length=128, test_max_depth=4``.

    Args:
        max_depth: operator nesting levels, >= 1 (default 3; the root is level 1).
        max_args: maximum arguments per operator, >= 2 (default 4; LRA uses 10).
        leaf_prob: probability that a non-root node above the depth limit is a digit (LRA: 0.75, i.e. its
            ``VALUE_P = 0.25`` chance of an operator). Default 0.5, for more nesting in short sequences
            (mean length about 20 tokens with the other defaults).
        max_length: longest train/val sequence in tokens, >= 4 (default 64); also ``seq_len``.
        min_length: shortest train/val sequence in tokens, >= 1 (default 1: no lower bound).
        test_max_depth, test_max_args, test_max_length, test_min_length: the same for the test split;
            ``None`` → the train value. ``max_len = max(max_length, test_max_length)``.
        **data: batch_size, num_train (default 5,000), num_val, num_test (1,000 each), seed, num_workers, resample:
            see :class:`~attnlab.tasks.base.DataOptions` (no ``test_lengths``: use the test_* settings).

    Batches: ``tokens LongTensor (B, L)`` right-padded with 0 (``L = max_length``, or ``test_max_length``
    for the test split), ``labels LongTensor (B,)`` in 0..9.
    """

    per_token = False
    data_defaults = DataOptions(num_train=5_000, num_val=1_000, num_test=1_000)
    length_keys = ("max_length", "test_max_length")
    evaluate = staticmethod(evaluate)
    to_tokens = staticmethod(to_tokens)
    detokenize = staticmethod(detokenize)

    def __init__(
        self,
        max_depth: int = 3,
        max_args: int = 4,
        leaf_prob: float = 0.5,
        max_length: int = 64,
        min_length: int = 1,
        test_max_depth: int | None = None,
        test_max_args: int | None = None,
        test_max_length: int | None = None,
        test_min_length: int | None = None,
        **data: Any,
    ) -> None:
        super().__init__(**data)
        self.leaf_prob = check_prob("leaf_prob", leaf_prob)
        self.max_depth, self.max_args, self.min_length, self.max_length = self._check_shape_args(
            "", max_depth, max_args, min_length, max_length
        )
        self.test_max_depth, self.test_max_args, self.test_min_length, self.test_max_length = self._check_shape_args(
            "test_",
            self.max_depth if test_max_depth is None else test_max_depth,
            self.max_args if test_max_args is None else test_max_args,
            self.min_length if test_min_length is None else test_min_length,
            self.max_length if test_max_length is None else test_max_length,
        )
        self.vocab_size = VOCAB_SIZE
        self.num_classes = 10
        self.seq_len = self.max_length
        self.max_len = max(self.max_length, self.test_max_length)

    def check_data(self, options: DataOptions) -> DataOptions:
        """Refuse ``test_lengths`` with a pointer to the test split's own length settings."""
        checked = super().check_data(replace(options, test_lengths=None))
        if options.test_lengths:
            raise ValueError(
                "task listops does not support test_lengths; set test_min_length and test_max_length for a longer "
                "test split"
            )
        return checked

    @staticmethod
    def _check_shape_args(
        prefix: str, max_depth: int, max_args: int, min_length: int, max_length: int
    ) -> tuple[int, int, int, int]:
        max_depth = check_int(f"{prefix}max_depth", max_depth, minimum=1)
        max_args = check_int(f"{prefix}max_args", max_args, minimum=2)
        max_length = check_int(f"{prefix}max_length", max_length, minimum=4)
        min_length = check_int(f"{prefix}min_length", min_length, minimum=1, maximum=max_length)
        longest = max_tree_length(max_depth, max_args)
        if min_length > longest:
            raise ValueError(
                f"{prefix}min_length ({min_length}) is longer than any tree with "
                f"{prefix}max_depth={max_depth} and {prefix}max_args={max_args} can be ({longest} tokens)"
            )
        return max_depth, max_args, min_length, max_length

    def split_len(self, split: str) -> int:
        """``max_length`` for train/val, ``test_max_length`` for test."""
        return self.test_max_length if split == "test" else self.max_length

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` expressions: tokens ``(num, split_len(split))`` right-padded with 0, labels ``(num,)``."""
        if split == "test":
            depth, args, lo, hi = (
                self.test_max_depth,
                self.test_max_args,
                self.test_min_length,
                self.test_max_length,
            )
        else:
            depth, args, lo, hi = self.max_depth, self.max_args, self.min_length, self.max_length
        draw = uniform_stream(rng)
        seqs: list[list[int]] = []
        labels: list[int] = []
        max_attempts = 10_000 + 100 * num
        attempts = 0
        while len(seqs) < num:
            attempts += 1
            if attempts > max_attempts:
                prefix = "test_" if split == "test" else ""
                raise ValueError(
                    f"ListOps {split} split: only {len(seqs)} of {num} trees had a length in [{lo}, {hi}] "
                    f"after {max_attempts} tries; relax {prefix}min_length/{prefix}max_length or change "
                    f"{prefix}max_depth/{prefix}max_args/leaf_prob"
                )
            try:
                tree = sample_tree(draw, depth, args, self.leaf_prob, hi)
            except TreeTooLongError:
                continue
            tokens = to_tokens(tree)
            if len(tokens) < lo:
                continue
            seqs.append(tokens)
            labels.append(evaluate(tree))
        return pad_sequences(seqs, hi), np.asarray(labels, dtype=np.int64)

    def _describe_details(self) -> str:
        text = (
            f"max_depth={self.max_depth}, max_args={self.max_args}, leaf_prob={self.leaf_prob}, "
            f"length {self.min_length}..{self.max_length}"
        )
        if (self.test_max_depth, self.test_max_args, self.test_min_length, self.test_max_length) != (
            self.max_depth,
            self.max_args,
            self.min_length,
            self.max_length,
        ):
            text += (
                f" (test: max_depth={self.test_max_depth}, max_args={self.test_max_args}, "
                f"length {self.test_min_length}..{self.test_max_length})"
            )
        return text
