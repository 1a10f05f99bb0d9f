"""Position-sensitive copy tasks from the length-generalisation literature: Shift, Reverse and Sort.

All three share one generator: ``n`` tokens drawn i.i.d. uniformly from the content ids ``1..vocab``, right-padded
with PAD (0) to the split's length, and a per-token label at every content position that says which token belongs
there: the one ``offset`` positions back (:class:`Shift`, the previous-token head of Olsson et al. 2022), the mirror
image (:class:`Reverse`, "reverse string" of Delétang et al. 2023 and Kazemnejad et al. 2023) or the sorted sequence
(:class:`Sort`, "sort" in the same two papers). Each label is a *token of the sequence*; what a model has to work out
is *which* one, and that depends on the position alone.

**Why positions are necessary (all three tasks).** Call a model permutation-equivariant if permuting the content
positions of its input permutes its outputs the same way: an encoder with no absolute positional encoding and no
relative position information (``model.pos_encoding=none`` with plain ``scaled_dot``, or Shaw relative positions
with ``clip=0``: one shared distance vector adds the same logit to every key). Its output at position ``i`` is then
``g(x_i, M)``: a function of the token there and of the multiset ``M`` of the sequence (which fixes ``n``), the same
function at every position. Because the tokens are i.i.d., the generator is symmetric: given ``M``, every ordering of
``M`` is equally likely. So given ``(x_i, M)`` the position ``i`` is uniform and the label, which depends on ``i``,
is just a draw from ``M``: for Shift (and Reverse away from the middle), a uniform draw from ``M`` with one copy of
``x_i`` removed; for Sort, the order statistic at a uniform position, i.e. a uniform draw from ``M``. The best such
model predicts the most frequent token of that multiset: the **bag-of-tokens guess**. With counts ``c_b`` of ``M``,
mode count ``m = max_b c_b`` and ``u = 1`` if the mode is unique (else 0), its expected number of correct labels in a
sequence of length ``n`` is exactly

* Sort: ``m`` (of ``n`` labels);
* Reverse: ``m`` for odd ``n``, ``m (n - u) / (n - 1)`` for even ``n`` (of ``n`` labels);
* Shift with offset ``k``: ``(n - k) m (n - u) / (n (n - 1))`` (of ``n - k`` labels).

(Derivation: the expected number correct is ``sum_i sum_a P(x_i = a | M) P(label_i = g(a) | x_i = a, M)``, and
``sum_a c_a max_b (c_b - [a = b]) = m (n - u)``.) Each task's ``chance_accuracy`` is this optimum, micro-averaged over
the training length distribution like the run's accuracy, estimated by Monte Carlo (:func:`bag_of_tokens_accuracy`,
a fixed generator: standard error about 0.0005 at the defaults). It falls as ``vocab`` grows; it is about 0.19 at the
defaults (``vocab = 16``, lengths 1 to 32: the short sequences are easy) and 0.15 at a fixed length 32. No
permutation-equivariant model can beat it, however long it trains. ``tests/test_position_tasks.py`` checks the
optimum by enumerating every sequence of a small vocabulary, and the premise on the encoder itself.

**Symmetric (bidirectional) ALiBi.** The bias ``-m_h |i - j|`` is the same for a key ``d`` positions to the left as
``d`` to the right, so with ``pos_encoding=none`` the model is *reflection*-equivariant: reversing the ``n`` content
tokens reverses the outputs (``f(x')_{n-1-i} = f(x)_i`` with ``x'_j = x_{n-1-j}``). ``x`` and ``x'`` are equally
likely, so one output must serve both labels. For Shift these are ``x_{i-k}`` and ``x_{i+k}`` at every position
``k <= i <= n-1-k``, so accuracy there is at most ``(1 + 1/vocab) / 2``; only the last ``k`` positions (whose mirror
images have no target) escape. For Sort they are the ``i``-th smallest and the ``i``-th largest token, which differ
except near the middle. Reverse is reflection-symmetric itself, so ALiBi is not excluded there by this argument (it
still has to find the mirror position ``n - 1 - i`` from distances alone). RoPE, Shaw (``clip >= 1``) and
bidirectional T5 buckets all tell left from right; sinusoidal and learned absolute encodings give the position itself.

Lengths: ``min_length <= n <= seq_len`` uniformly per sequence (by default every length that has a target, up to
``seq_len = 32``; ``min_length = seq_len``: fixed length, no padding). The test sets of ``test_lengths`` (length
generalisation) hold sequences of *exactly* the given length, no padding, so ``test/acc@L`` is the accuracy at length
``L`` (unseen in training when ``L > seq_len``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnlab.checks import check_int
from attnlab.tasks import register_task
from attnlab.tasks.base import IGNORE_INDEX, PAD_ID, DataOptions, SequenceTask

__all__ = ["PositionTask", "Reverse", "Shift", "Sort", "bag_of_tokens_accuracy"]

CHANCE_SAMPLES: int = 20_000
"""Monte-Carlo sequences behind ``chance_accuracy`` (fewer when ``min(vocab, seq_len) > 100``: at most 2M numbers)."""


def _mode_counts(rng: np.random.Generator, n: np.ndarray, vocab: int, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """For ``len(n)`` random sequences of i.i.d. uniform tokens over ``vocab`` ids with lengths ``n``: the count of
    the most frequent token ``m (S,)`` and whether it is the only token with that count ``u (S,) bool``. Works on
    per-token counts ``(S, vocab)`` or on sorted tokens ``(S, max_length)``, whichever is smaller."""
    if vocab <= max_length:
        counts = rng.multinomial(n, np.full(vocab, 1.0 / vocab))  # (S, vocab): the multiset of each sequence
    else:  # run lengths of each sorted row; PAD (-1) sorts first and its run is not counted
        num = len(n)
        tokens = rng.integers(0, vocab, size=(num, max_length))
        tokens[np.arange(max_length)[None, :] >= n[:, None]] = -1
        tokens.sort(axis=1)
        new_run = np.ones((num, max_length), dtype=bool)
        new_run[:, 1:] = tokens[:, 1:] != tokens[:, :-1]
        run = np.cumsum(new_run, axis=1) - 1  # (S, L): run index within the row
        flat = (np.arange(num)[:, None] * max_length + run)[tokens >= 0]
        counts = np.bincount(flat, minlength=num * max_length).reshape(num, max_length)
    mode = counts.max(axis=1)
    return mode, (counts == mode[:, None]).sum(axis=1) == 1


def bag_of_tokens_accuracy(
    kind: str, vocab: int, min_length: int, max_length: int, offset: int = 1, samples: int = CHANCE_SAMPLES
) -> float:
    """Micro-averaged accuracy of the best permutation-equivariant guess (see the module docstring), for sequences of
    i.i.d. uniform tokens over ``vocab`` ids with length uniform in ``[min_length, max_length]``.

    ``kind`` is ``"shift"``, ``"reverse"`` or ``"sort"``; ``offset`` is Shift's. A Monte-Carlo estimate over
    ``samples`` sequences from a fixed generator (the same value every call).
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(2023)))
    samples = max(1_000, min(samples, 2_000_000 // min(vocab, max_length)))
    n = rng.integers(min_length, max_length + 1, size=samples)  # (S,)
    mode, unique = _mode_counts(rng, n, vocab, max_length)  # m, u
    mode = mode.astype(np.float64)
    nf = n.astype(np.float64)
    # the label is a uniform draw from M minus one copy of x_i: m (n - u) / (n - 1) correct per n labels
    others = mode * (nf - unique) / np.maximum(nf - 1, 1)
    if kind == "sort":
        correct, labelled = mode, nf
    elif kind == "reverse":
        correct, labelled = np.where(n % 2 == 1, mode, others), nf
    elif kind == "shift":
        correct, labelled = (nf - offset) / nf * others, nf - offset
    else:
        raise ValueError(f"kind must be one of shift, reverse, sort, got {kind!r}")
    return float(correct.sum() / labelled.sum())


class PositionTask(SequenceTask):
    """Common part of :class:`Shift`, :class:`Reverse` and :class:`Sort` (per-token labels).

    Token ids (``vocab_size = vocab + 1``):

    * ``0``: PAD (only after the ``n`` content tokens).
    * ``1 .. vocab``: content, i.i.d. uniform.

    Labels: the class of a content token ``t`` is ``t - 1`` (``num_classes = vocab``); the label of position ``i``
    is the class of the token the task puts there, or ``-100`` (:data:`IGNORE_INDEX`) at PAD and wherever the task
    has no target. Subclasses implement :meth:`labels_for`.

    Args:
        vocab: content token ids, ``>= 2``.
        seq_len: longest training sequence (the padded length of the train, val and test splits), ``>= 1``.
        min_length: shortest training sequence; ``None`` → the shortest with a target (1; Shift: ``offset + 1``), as
            Delétang et al. 2023 train on all lengths up to a maximum. Each sequence's true length is uniform in
            ``[min_length, seq_len]``; ``min_length = seq_len`` gives fixed-length sequences without padding.
        **data: batch_size, num_train (default 10,000), num_val, num_test (1,000 each), seed, num_workers,
            resample, test_lengths (each a test set of sequences of exactly that length, no padding; see
            :meth:`check_length`): see :class:`~attnlab.tasks.base.DataOptions`.

    Batches: ``tokens LongTensor (B, L)``, ``labels LongTensor (B, L)``.
    """

    name = "position_task"
    per_token = True
    data_defaults = DataOptions(num_train=10_000, num_val=1_000, num_test=1_000)
    length_keys = ("seq_len", "min_length")
    shortest: int = 1
    """Shortest sequence that has a target (Shift: ``offset + 1``)."""

    def __init__(
        self,
        vocab: int = 16,
        seq_len: int = 32,
        min_length: int | None = None,
        **data: Any,
    ) -> None:
        super().__init__(**data)
        self.vocab = check_int("vocab", vocab, minimum=2)
        self.seq_len = self.check_length(seq_len, "seq_len")
        if min_length is None:
            min_length = self.shortest
        self.min_length = self.check_length(min_length, "min_length")
        if self.min_length > self.seq_len:
            raise ValueError(f"min_length must be <= seq_len = {self.seq_len}, got {self.min_length}")
        self.vocab_size = self.vocab + 1
        self.num_classes = self.vocab
        self.max_len = self.seq_len
        self.chance_accuracy = self.bag_of_tokens_accuracy(self.min_length, self.seq_len)
        self.check_test_lengths()

    def bag_of_tokens_accuracy(self, min_length: int, max_length: int) -> float:
        """The best permutation-equivariant accuracy for lengths uniform in ``[min_length, max_length]`` (Shift's
        offset is ``shortest - 1``)."""
        return bag_of_tokens_accuracy(self.name, self.vocab, min_length, max_length, offset=self.shortest - 1)

    def check_length(self, length: int, name: str = "test_lengths") -> int:
        """``length`` if a sequence that long has a target (``>= 1``; Shift: ``>= offset + 1``), else a one-line
        ``ValueError``; there is no upper bound. Used for ``seq_len``, ``min_length`` and each of ``test_lengths``."""
        return check_int(name, length, minimum=self.shortest)

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` sequences of true length uniform in ``[min_length, seq_len]``, padded to ``seq_len``: tokens and
        labels ``(num, seq_len)`` (int64)."""
        return self._generate(num, rng, self.min_length, self.seq_len)

    def generate_length(self, num: int, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``num`` sequences of exactly ``length`` tokens (no padding): tokens and labels ``(num, length)``."""
        self.check_length(length)
        return self._generate(num, rng, length, length)

    def _generate(
        self, num: int, rng: np.random.Generator, min_length: int, length: int
    ) -> tuple[np.ndarray, np.ndarray]:
        lengths = rng.integers(min_length, length + 1, size=num)  # (num,) true lengths n
        tokens = rng.integers(1, self.vocab + 1, size=(num, length))  # (num, length) content ids
        content = np.arange(length)[None, :] < lengths[:, None]  # (num, length)
        tokens[~content] = PAD_ID
        labels = self.labels_for(tokens, lengths, content)
        return tokens.astype(np.int64), labels.astype(np.int64)

    def labels_for(self, tokens: np.ndarray, lengths: np.ndarray, content: np.ndarray) -> np.ndarray:
        """Labels ``(num, L)`` of padded ``tokens (num, L)`` with true ``lengths (num,)``; ``content`` is the
        ``(num, L)`` mask of positions ``i < n``."""
        raise NotImplementedError

    def _describe_details(self) -> str:
        return f"vocab={self.vocab}, lengths {self.min_length}..{self.seq_len}, chance={self.chance_accuracy:.3f}"


@register_task("shift")
class Shift(PositionTask):
    """Shift by ``offset`` (default 1: "previous token"): the label at position ``i`` is the token at ``i - offset``.

    What it tests: attending to the key a fixed distance back, the previous-token head of induction circuits (Olsson
    et al. 2022), and the simplest copy task of Delétang et al. 2023 / Kazemnejad et al. 2023. The distance is fixed,
    so it is solvable at every length by a scheme that knows relative offsets (RoPE, Shaw with ``clip >= offset``,
    T5 buckets, and sinusoidal absolute encodings, whose shift is a fixed linear map); a learned absolute table has
    to learn it per position, and fails past the rows that training updated. It is *not* solvable by a
    permutation-equivariant model (``pos_encoding=none``, Shaw with ``clip=0``: best is the bag-of-tokens guess,
    ``chance_accuracy``) nor, away from the ends, by symmetric ALiBi, which cannot tell ``i - offset`` from
    ``i + offset`` (at most about ``(1 + 1/vocab) / 2``); both proofs are in :mod:`attnlab.tasks.position`.

    Example (``offset = 1``, tokens shown as ids, ``n = 5`` padded to 7)::

        tokens:  3  9  9  1  4  0  0
        labels: -100 2  8  8  0 -100 -100     (class = token - 1)

    Labels are ``-100`` at ``i < offset`` and at PAD.

    Args:
        offset: the distance back, ``>= 1``; ``seq_len``, ``min_length`` and every test length must be at least
            ``offset + 1`` (the shortest sequence with a target).
        vocab, seq_len, min_length, **data: see :class:`PositionTask`.
    """

    def __init__(self, offset: int = 1, **kwargs: Any) -> None:
        self.offset = check_int("offset", offset, minimum=1)
        self.shortest = self.offset + 1
        super().__init__(**kwargs)

    def check_length(self, length: int, name: str = "test_lengths") -> int:
        """``length`` if it is at least ``offset + 1`` (the shortest sequence with a target), else a ``ValueError``."""
        value = check_int(name, length)
        if value < self.shortest:
            raise ValueError(f"{name} must be >= offset + 1 = {self.shortest} (no target otherwise), got {value}")
        return value

    def labels_for(self, tokens: np.ndarray, lengths: np.ndarray, content: np.ndarray) -> np.ndarray:
        k = self.offset
        labels = np.full(tokens.shape, IGNORE_INDEX, dtype=np.int64)
        # position i >= k gets the class of token i - k, if i is a content position (then so is i - k)
        labels[:, k:] = np.where(content[:, k:], tokens[:, :-k] - 1, IGNORE_INDEX)
        return labels

    def _describe_details(self) -> str:
        return f"offset={self.offset}, {super()._describe_details()}"


@register_task("reverse")
class Reverse(PositionTask):
    """Reverse the sequence: the label at position ``i`` of a sequence of true length ``n`` is the token at
    ``n - 1 - i``.

    What it tests: attending to a key whose place depends on both the query's position and the sequence length
    ("reverse string", Delétang et al. 2023; Kazemnejad et al. 2023). With padding, the model must also infer ``n``
    (the PAD keys are masked, so from the content positions alone). Absolute encodings (sinusoidal, learned) can solve
    it within the training lengths; purely relative schemes (RoPE, Shaw, T5) see no absolute position and must
    recover it (e.g. from the distance to the sequence's ends); and every scheme has to extrapolate the mirror map to
    unseen lengths. Not solvable by a permutation-equivariant model (``pos_encoding=none``, Shaw with ``clip=0``): the
    best is the bag-of-tokens guess, ``chance_accuracy`` (proof in :mod:`attnlab.tasks.position`). Unlike Shift and
    Sort the task is reflection-symmetric, so symmetric ALiBi is not ruled out by that argument.

    Example (``n = 5`` padded to 7)::

        tokens:  3  9  9  1  4  0  0
        labels:  3  0  8  8  2 -100 -100      (class = token - 1)

    Labels are ``-100`` at PAD only. Sequences of odd length copy their middle token.

    Args: see :class:`PositionTask`.
    """

    def labels_for(self, tokens: np.ndarray, lengths: np.ndarray, content: np.ndarray) -> np.ndarray:
        source = lengths[:, None] - 1 - np.arange(tokens.shape[1])[None, :]  # (num, L): n - 1 - i
        mirrored = np.take_along_axis(tokens, np.clip(source, 0, None), axis=1)
        return np.where(content, mirrored - 1, IGNORE_INDEX)


@register_task("sort")
class Sort(PositionTask):
    """Sort the sequence: the label at position ``i`` is the ``i``-th smallest token (from 0; ties repeat, so with
    repeats the sorted sequence is unique and the sort's stability does not matter).

    What it tests: counting and ranking by content ("sort", Delétang et al. 2023; Kazemnejad et al. 2023): position
    ``i`` must output the token ``t`` with ``#{tokens < t} <= i < #{tokens <= t}``, so the model needs the histogram of
    the sequence (a content operation any attention can do) *and* its own absolute position ``i`` to compare with it.
    Absolute encodings give ``i``; relative schemes must infer it (e.g. by counting tokens to the left). Not solvable
    by a permutation-equivariant model: the best is predicting the most frequent token, ``chance_accuracy`` (proof in
    :mod:`attnlab.tasks.position`); nor by symmetric ALiBi, which cannot tell ascending from descending order.

    Example (``n = 5`` padded to 7)::

        tokens:  3  9  9  1  4  0  0
        labels:  0  2  3  8  8 -100 -100      (sorted ids 1 3 4 9 9, class = token - 1)

    Labels are ``-100`` at PAD only.

    Args: see :class:`PositionTask`.
    """

    def labels_for(self, tokens: np.ndarray, lengths: np.ndarray, content: np.ndarray) -> np.ndarray:
        ranked = np.sort(np.where(content, tokens, self.vocab + 1), axis=1)  # PAD sorts after every content id
        return np.where(content, ranked - 1, IGNORE_INDEX)
