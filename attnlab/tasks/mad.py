"""The synthetic tasks of MAD (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid Architectures",
arXiv 2403.17844; reference code github.com/athms/mad-lab), as seeded, download-free per-token tasks.

MAD has six tasks. In-context recall is :class:`~attnlab.tasks.associative_recall.AssociativeRecall` (MQAR,
``task=associative_recall``); this module adds the other five:

* :class:`FuzzyRecall` (``fuzzy_recall``): recall with keys and values of several tokens each.
* :class:`NoisyRecall` (``noisy_recall``): MQAR with noise tokens of their own vocabulary between the pairs.
* :class:`SelectiveCopy` (``selective_copy``): copy the content tokens of a region full of noise, in order.
* :class:`Compression` (``compression``): reproduce a random sequence after a compression token.
* :class:`Memorization` (``memorization``): a fixed key → value map that only the weights can hold.

MAD trains causal language models on them (the targets are the inputs shifted by one). Here, as for MQAR, every
task labels only the positions that hold an answer and leaves every other label at ``-100``
(:data:`~attnlab.tasks.base.IGNORE_INDEX`); the input at an answer position is a key to recall by, a marker or a
blank, never the answer itself. So every label is a function of the tokens at and before its position (a causal
model can reach it; the task configs select ``mask=causal``, as MAD runs them), and no label appears as a later
input token either: a bidirectional mask does not leak one (none of them sets ``requires_causal``).

Token 0 is PAD in every task (only :class:`FuzzyRecall`, whose sequences vary in length, has PAD positions); each
class docstring lists its token ids, its layout, what is labelled and its ``chance_accuracy``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnlab.checks import check_int, check_number
from attnlab.tasks import register_task
from attnlab.tasks.base import IGNORE_INDEX, PAD_ID, DataOptions, SequenceTask, distinct_rows
from attnlab.tasks.position import bag_of_tokens_accuracy

__all__ = ["Compression", "FuzzyRecall", "Memorization", "NoisyRecall", "SelectiveCopy"]

CHANCE_SAMPLES: int = 4_000
"""Monte-Carlo sequences behind :class:`FuzzyRecall`'s ``chance_accuracy``."""

MAD_DEFAULTS = DataOptions(num_train=10_000, num_val=1_000, num_test=1_000)
"""The split sizes of every MAD task (as MQAR's); ``batch_size`` and ``seed`` come from the root config."""


# ------------------------------------------------------------------------------------------------ fuzzy recall


@register_task("fuzzy_recall")
class FuzzyRecall(SequenceTask):
    """Fuzzy in-context recall (MAD): keys of 1 to ``key_len`` tokens, values of 1 to ``value_len`` tokens; at a
    query (a whole key again) the model writes out the key's value, one token per answer slot.

    Token ids (``vocab_size = vocab_keys + vocab_values + 2``):

    * ``0``: PAD (right padding, after the last query).
    * ``1 .. vocab_keys``: key tokens (``key_offset = 1``).
    * ``vocab_keys + 1 .. vocab_keys + vocab_values``: value tokens (``value_offset``).
    * ``vocab_keys + vocab_values + 1``: BLANK (``blank_id``), an answer slot.

    Layout, ``n = num_pairs``, ``m = num_queries``::

        K1 V1 K2 V2 ... Kn Vn | Q1 _ _ Q2 _ ... Qm _ _ | PAD ...
        (Ki: 1..key_len key tokens, Vi: 1..value_len value tokens; Qj: a context key; _: BLANK)

    * A key is a tuple of key tokens and a value a tuple of value tokens; the two vocabularies are disjoint (as in
      MAD), so a key ends where the value tokens (or the BLANKs of a query) begin. Each key's length is uniform in
      ``1..key_len`` and its tokens uniform; the ``n`` keys of a sequence are distinct (a key equal to an earlier
      one is redrawn at its length; a length whose keys are all taken is replaced by a uniform one that is not).
      Keys differ in length (MAD's variable "motifs"), and a 1-token key can be the last token of a 2-token one,
      so the lookup must compare whole keys, not their last tokens.
    * Each value's length is uniform in ``1..value_len`` and its tokens uniform (values may repeat).
    * Then ``m`` distinct context keys, chosen without replacement in random order, each followed by as many BLANK
      slots as its value has tokens. The label at the ``j``-th BLANK after a query is the class
      ``v_j - value_offset`` in ``[0, vocab_values)`` of the ``j``-th token of that key's value; every other label
      is ``-100``. (MAD teacher-forces the value tokens after the query; BLANK slots keep the value out of the
      input, so the label at a slot needs only the earlier tokens and no later token holds it.)
    * MAD prompts its test set with keys of the longest length only; here every split has the same distribution.
    * Sequences vary in length (at most ``(n + m) * (key_len + value_len)``) and are right-padded to ``seq_len``.

    ``chance_accuracy`` is the bag-of-values guess, MQAR's ``1 / num_pairs`` carried to multi-token values: a model that
    knows which values the context holds and how far into an answer it is, but not which key each value belongs to,
    predicts at the ``j``-th slot the most frequent ``j``-th token among the context values of at least ``j`` tokens
    (at the second slot only the values of two tokens or more remain: fewer candidates). Its accuracy, averaged over
    the labels, is estimated by Monte Carlo (:meth:`bag_of_values_accuracy`, ``CHANCE_SAMPLES`` sequences from a
    fixed generator): 0.46 at the defaults, above ``1 / num_pairs`` = 0.25 (a 2-layer model sits near 0.36 before it
    learns the recall).

    Args:
        num_pairs: key-value pairs in the context, ``n >= 1``, at most the number of distinct keys
            (``vocab_keys + vocab_keys**2 + ... + vocab_keys**key_len``).
        num_queries: queries, ``1 <= m <= num_pairs``; ``None`` → ``num_pairs``.
        key_len: the longest key, ``>= 1`` tokens (MAD's ``k_motif_size``).
        value_len: the longest value, ``>= 1`` tokens (MAD's ``v_motif_size``).
        vocab_keys: key token ids, ``>= 1``.
        vocab_values: value token ids (= ``num_classes``), ``>= 2``.
        seq_len: the padded length, ``>= (num_pairs + num_queries) * (key_len + value_len)``; ``None`` → that.
        **data: batch_size, num_train (default 10,000), num_val, num_test (1,000 each), seed, num_workers,
            resample: see :class:`~attnlab.tasks.base.DataOptions`.

    Batches: ``tokens LongTensor (B, seq_len)``, ``labels LongTensor (B, seq_len)``.
    """

    per_token = True
    data_defaults = MAD_DEFAULTS
    length_keys = ("seq_len", "num_pairs")

    def __init__(
        self,
        num_pairs: int = 4,
        num_queries: int | None = None,
        key_len: int = 2,
        value_len: int = 2,
        vocab_keys: int = 8,
        vocab_values: int = 8,
        seq_len: int | None = None,
        **data: Any,
    ) -> None:
        super().__init__(**data)
        self.key_len = check_int("key_len", key_len, minimum=1)
        self.value_len = check_int("value_len", value_len, minimum=1)
        self.vocab_keys = check_int("vocab_keys", vocab_keys, minimum=1)
        self.vocab_values = check_int("vocab_values", vocab_values, minimum=2)
        self.num_keys = sum(self.vocab_keys**a for a in range(1, self.key_len + 1))
        """Distinct keys of 1..key_len tokens."""
        self.num_pairs = check_int("num_pairs", num_pairs, minimum=1)
        if self.num_pairs > self.num_keys:
            raise ValueError(
                f"num_pairs must be an integer in [1, {self.num_keys}] (the distinct keys of 1..key_len={self.key_len}"
                f" tokens from vocab_keys={self.vocab_keys}), got {self.num_pairs}"
            )
        if num_queries is None:
            num_queries = self.num_pairs
        self.num_queries = check_int("num_queries", num_queries, minimum=1, maximum=self.num_pairs)
        self.min_len = (self.num_pairs + self.num_queries) * (self.key_len + self.value_len)
        if seq_len is None:
            seq_len = self.min_len
        seq_len = check_int("seq_len", seq_len)
        if seq_len < self.min_len:
            raise ValueError(
                f"seq_len must be >= (num_pairs + num_queries) * (key_len + value_len) = {self.min_len}, got {seq_len}"
            )
        self.key_offset: int = 1
        self.value_offset: int = 1 + self.vocab_keys
        self.blank_id: int = 1 + self.vocab_keys + self.vocab_values
        self.vocab_size = self.vocab_keys + self.vocab_values + 2
        self.num_classes = self.vocab_values
        self.seq_len = self.max_len = seq_len
        self.chance_accuracy = self.bag_of_values_accuracy()

    def _keys(self, rng: np.random.Generator, num: int) -> list[list[tuple[int, ...]]]:
        """``num`` rows of ``num_pairs`` distinct keys (tuples of key classes in ``[0, vocab_keys)``)."""
        n, kl, vocab = self.num_pairs, self.key_len, self.vocab_keys
        lengths = rng.integers(1, kl + 1, size=(num, n))  # drawn in bulk; redrawn below only on a clash
        draws = rng.integers(0, vocab, size=(num, n, kl))
        capacity = [vocab**a for a in range(kl + 1)]
        rows = []
        for r in range(num):
            used: set[tuple[int, ...]] = set()
            taken = [0] * (kl + 1)
            row = []
            for i in range(n):
                a = int(lengths[r, i])
                if taken[a] == capacity[a]:  # every key of this length is used: a uniform length that is not
                    free = [b for b in range(1, kl + 1) if taken[b] < capacity[b]]
                    a = free[int(rng.integers(len(free)))]
                key = tuple(draws[r, i, :a].tolist())
                while key in used:
                    key = tuple(rng.integers(0, vocab, size=a).tolist())
                used.add(key)
                taken[a] += 1
                row.append(key)
            rows.append(row)
        return rows

    def _draw(
        self, rng: np.random.Generator, num: int
    ) -> tuple[list[list[tuple[int, ...]]], np.ndarray, np.ndarray, np.ndarray]:
        """The parts of ``num`` sequences: keys (``num`` rows of ``num_pairs`` tuples of key classes), value lengths
        ``(num, n)``, value classes ``(num, n, value_len)`` (the first ``length`` of each are the value) and the
        queried pair indices ``(num, m)``, in query order."""
        keys = self._keys(rng, num)
        value_lengths = rng.integers(1, self.value_len + 1, size=(num, self.num_pairs))
        values = rng.integers(0, self.vocab_values, size=(num, self.num_pairs, self.value_len))
        queried = distinct_rows(rng, num, self.num_pairs, self.num_queries)  # random order
        return keys, value_lengths, values, queried

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` fuzzy-recall sequences, right-padded: tokens and labels ``(num, seq_len)`` (int64)."""
        keys, value_lengths, values, queried = self._draw(rng, num)
        tokens = np.full((num, self.seq_len), PAD_ID, dtype=np.int64)
        labels = np.full((num, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        ko, vo = self.key_offset, self.value_offset
        for r in range(num):
            row: list[int] = []
            for i in range(self.num_pairs):
                row += [k + ko for k in keys[r][i]] + [v + vo for v in values[r, i, : value_lengths[r, i]].tolist()]
            row_labels = [IGNORE_INDEX] * len(row)
            for i in queried[r].tolist():
                value = values[r, i, : value_lengths[r, i]].tolist()
                row += [k + ko for k in keys[r][i]] + [self.blank_id] * len(value)
                row_labels += [IGNORE_INDEX] * len(keys[r][i]) + value
            tokens[r, : len(row)] = row
            labels[r, : len(row)] = row_labels
        return tokens, labels

    def bag_of_values_accuracy(self, samples: int = CHANCE_SAMPLES) -> float:
        """The accuracy of the bag-of-values guess (see the class docstring), micro-averaged over the labels of
        ``samples`` sequences from a fixed generator (the same value every call)."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(2024)))
        _, lengths, values, queried = self._draw(rng, samples)
        asked = np.take_along_axis(lengths, queried, 1)  # (S, m) lengths of the queried values
        correct = labelled = 0.0
        for j in range(self.value_len):
            holds = lengths > j  # (S, n): the values with a j-th token
            counts = np.zeros((samples, self.vocab_values))
            np.add.at(counts, (np.nonzero(holds)[0], values[:, :, j][holds]), 1)
            slots = (asked > j).sum(axis=1)  # (S,) labels at the j-th slot
            candidates = np.maximum(holds.sum(axis=1), 1)
            correct += float((slots * counts.max(axis=1) / candidates).sum())
            labelled += float(slots.sum())
        return correct / labelled

    def _describe_details(self) -> str:
        return (
            f"num_pairs={self.num_pairs}, num_queries={self.num_queries}, keys of 1..{self.key_len} tokens from "
            f"vocab_keys={self.vocab_keys}, values of 1..{self.value_len} tokens from vocab_values={self.vocab_values}"
            f", chance={self.chance_accuracy:.3f}"
        )


# ------------------------------------------------------------------------------------------------ noisy recall


@register_task("noisy_recall")
class NoisyRecall(SequenceTask):
    """Noisy in-context recall (MAD): MQAR whose context has noise tokens, from a vocabulary of their own, between
    the key-value pairs.

    Token ids (``vocab_size = vocab_keys + vocab_values + vocab_noise + 1``):

    * ``0``: PAD (never used: every sequence is ``seq_len`` long).
    * ``1 .. vocab_keys``: keys (``key_offset = 1``).
    * ``vocab_keys + 1 .. vocab_keys + vocab_values``: values (``value_offset``).
    * ``vocab_keys + vocab_values + 1 ..`` (``vocab_noise`` ids): noise (``noise_offset``).

    Layout, ``n = num_pairs``, ``m = num_queries``, ``N = num_noise``::

        [n pairs "k v" and N noise tokens, in random order] | q1 q2 ... qm
        label: -100 in the context                          | value class at each query

    * Keys are distinct and so are values (as in MQAR). ``N = round(frac_noise * 2n / (1 - frac_noise))`` noise
      tokens, i.i.d. uniform over the noise ids, so that about ``frac_noise`` of the context is noise; the ``n``
      pairs (never split) and the ``N`` noise tokens are placed in a uniformly random order, so noise lies before,
      between and after the pairs, in runs of any length. (MAD makes each pair slot noise with probability
      ``frac_noise``, which varies the number of pairs; a fixed count keeps every sequence the same length.)
    * The query region holds ``m`` distinct context keys in random order; the label at a query is the class
      ``v - value_offset`` in ``[0, vocab_values)`` of the value that followed the key (as MQAR labels its
      queries); every other label is ``-100``. ``seq_len = 2n + N + m``.

    ``chance_accuracy`` is ``1 / num_pairs``, as MQAR's.

    Args:
        num_pairs: key-value pairs, ``n >= 1``.
        num_queries: queries, ``1 <= m <= num_pairs``; ``None`` → ``num_pairs``.
        vocab_keys: key ids, ``>= num_pairs``.
        vocab_values: value ids (= ``num_classes``), ``>= num_pairs``.
        vocab_noise: noise ids, ``>= 1``.
        frac_noise: the noise fraction of the context, in ``[0, 1)`` (MAD's baseline 0.2, harder settings up to 0.8).
        **data: batch_size, num_train (default 10,000), num_val, num_test (1,000 each), seed, num_workers,
            resample: see :class:`~attnlab.tasks.base.DataOptions`.

    Batches: ``tokens LongTensor (B, seq_len)``, ``labels LongTensor (B, seq_len)``.
    """

    per_token = True
    data_defaults = MAD_DEFAULTS
    length_keys = ("num_pairs", "frac_noise")

    def __init__(
        self,
        num_pairs: int = 8,
        num_queries: int | None = None,
        vocab_keys: int = 16,
        vocab_values: int = 16,
        vocab_noise: int = 8,
        frac_noise: float = 0.4,
        **data: Any,
    ) -> None:
        super().__init__(**data)
        self.num_pairs = check_int("num_pairs", num_pairs, minimum=1)
        if num_queries is None:
            num_queries = self.num_pairs
        self.num_queries = check_int("num_queries", num_queries, minimum=1, maximum=self.num_pairs)
        self.vocab_keys = check_int("vocab_keys", vocab_keys, minimum=self.num_pairs)
        self.vocab_values = check_int("vocab_values", vocab_values, minimum=self.num_pairs)
        self.vocab_noise = check_int("vocab_noise", vocab_noise, minimum=1)
        self.frac_noise = check_number("frac_noise", frac_noise, 0.0, 1.0, high_open=True)
        self.num_noise = math.floor(self.frac_noise * 2 * self.num_pairs / (1 - self.frac_noise) + 0.5)
        self.key_offset: int = 1
        self.value_offset: int = 1 + self.vocab_keys
        self.noise_offset: int = 1 + self.vocab_keys + self.vocab_values
        self.vocab_size = self.vocab_keys + self.vocab_values + self.vocab_noise + 1
        self.num_classes = self.vocab_values
        self.context_len = 2 * self.num_pairs + self.num_noise
        self.seq_len = self.max_len = self.context_len + self.num_queries
        self.chance_accuracy = 1.0 / self.num_pairs

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` noisy-recall sequences: tokens and labels ``(num, seq_len)`` (int64)."""
        n, m, noise, c = self.num_pairs, self.num_queries, self.num_noise, self.context_len
        keys = distinct_rows(rng, num, self.vocab_keys, n)  # (num, n)
        values = distinct_rows(rng, num, self.vocab_values, n)  # (num, n)
        # n + N units, n of them pairs (width 2) at uniformly random unit slots, the others noise (width 1)
        units = n + noise
        is_pair = np.zeros((num, units), dtype=bool)
        np.put_along_axis(is_pair, distinct_rows(rng, num, units, n), True, axis=1)
        width = np.where(is_pair, 2, 1)
        start = np.cumsum(width, axis=1) - width  # (num, units): where each unit begins
        pair_start = start[is_pair].reshape(num, n)  # in order of position: the i-th pair of the context
        tokens = np.empty((num, self.seq_len), dtype=np.int64)
        if noise:
            noise_start = start[~is_pair].reshape(num, noise)
            np.put_along_axis(
                tokens, noise_start, rng.integers(0, self.vocab_noise, (num, noise)) + self.noise_offset, 1
            )
        np.put_along_axis(tokens, pair_start, keys + self.key_offset, 1)
        np.put_along_axis(tokens, pair_start + 1, values + self.value_offset, 1)
        queried = distinct_rows(rng, num, n, m)  # (num, m) pair indices, random order
        tokens[:, c:] = np.take_along_axis(keys, queried, 1) + self.key_offset
        labels = np.full((num, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        labels[:, c:] = np.take_along_axis(values, queried, 1)
        return tokens, labels

    def _describe_details(self) -> str:
        return (
            f"num_pairs={self.num_pairs}, num_queries={self.num_queries}, vocab_keys={self.vocab_keys}, "
            f"vocab_values={self.vocab_values}, {self.num_noise} noise tokens (frac_noise={self.frac_noise:g}) from "
            f"vocab_noise={self.vocab_noise}, chance={self.chance_accuracy:.3f}"
        )


# ------------------------------------------------------------------------------------------------ selective copy


@register_task("selective_copy")
class SelectiveCopy(SequenceTask):
    """Selective copying (MAD; Gu and Dao 2023): content tokens scattered among noise tokens, then one COPY marker
    per content token; at the ``j``-th marker the model outputs the ``j``-th content token.

    Token ids (``vocab_size = vocab + 3``):

    * ``0``: PAD (never used: every sequence is ``seq_len`` long).
    * ``1 .. vocab``: content, i.i.d. uniform (class ``token - 1``; ``num_classes = vocab``).
    * ``vocab + 1``: NOISE (``noise_id``, MAD's blank token).
    * ``vocab + 2``: COPY (``copy_id``), the output slots.

    Layout, ``k = num_tokens``, ``R = seq_len - k``::

        position: 0 .. R-1                                 | R .. R+k-1
        token:    k content tokens at sorted random places | COPY x k
                  among R - k NOISE tokens                 |
        label:    -100                                     | class of the 1st, 2nd, ... content token

    The positions of the content tokens are a uniform random ``k``-subset of the region, drawn per sequence.
    (MAD's layout is the region, one copy token and ``k`` blank output slots; here the ``k`` markers are the
    slots.) The label at the ``j``-th COPY needs only the region before it.

    ``chance_accuracy`` is the bag-of-tokens guess: a model blind to the order of the region knows only the multiset
    of the ``k`` content tokens, each output slot is a uniform draw from it, and the best it can do is predict the
    most frequent, ``E[mode count] / k`` (Sort's formula: :func:`~attnlab.tasks.position.bag_of_tokens_accuracy`;
    0.26 at the defaults).

    Args:
        num_tokens: content tokens to copy, ``k >= 1``.
        vocab: content ids, ``>= 2``.
        seq_len: total length ``>= 2 * num_tokens`` (``seq_len - 2 * num_tokens`` NOISE tokens).
        **data: batch_size, num_train (default 10,000), num_val, num_test (1,000 each), seed, num_workers,
            resample: see :class:`~attnlab.tasks.base.DataOptions`.

    Batches: ``tokens LongTensor (B, seq_len)``, ``labels LongTensor (B, seq_len)``.
    """

    per_token = True
    data_defaults = MAD_DEFAULTS
    length_keys = ("seq_len", "num_tokens")

    def __init__(self, num_tokens: int = 8, vocab: int = 16, seq_len: int = 32, **data: Any) -> None:
        super().__init__(**data)
        self.num_tokens = check_int("num_tokens", num_tokens, minimum=1)
        self.vocab = check_int("vocab", vocab, minimum=2)
        seq_len = check_int("seq_len", seq_len)
        if seq_len < 2 * self.num_tokens:
            raise ValueError(f"seq_len must be >= 2*num_tokens = {2 * self.num_tokens}, got {seq_len}")
        self.noise_id: int = self.vocab + 1
        self.copy_id: int = self.vocab + 2
        self.vocab_size = self.vocab + 3
        self.num_classes = self.vocab
        self.seq_len = self.max_len = seq_len
        self.region_len = seq_len - self.num_tokens
        self.chance_accuracy = bag_of_tokens_accuracy("sort", self.vocab, self.num_tokens, self.num_tokens)

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` selective-copy sequences: tokens and labels ``(num, seq_len)`` (int64)."""
        k, r = self.num_tokens, self.region_len
        content = rng.integers(0, self.vocab, size=(num, k))  # (num, k) classes, in order
        places = np.sort(distinct_rows(rng, num, r, k), axis=1)  # (num, k) region positions, increasing
        tokens = np.full((num, self.seq_len), self.noise_id, dtype=np.int64)
        np.put_along_axis(tokens, places, content + 1, axis=1)
        tokens[:, r:] = self.copy_id
        labels = np.full((num, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        labels[:, r:] = content
        return tokens, labels

    def _describe_details(self) -> str:
        return (
            f"num_tokens={self.num_tokens} among {self.region_len - self.num_tokens} noise tokens, vocab={self.vocab}, "
            f"chance={self.chance_accuracy:.3f}"
        )


# ------------------------------------------------------------------------------------------------ compression


@register_task("compression")
class Compression(SequenceTask):
    """Compression (MAD): a random sequence ends with a compression token; the model reproduces the sequence from
    there.

    MAD's compression model is an auto-encoder: the encoder's output at the compression token alone goes through an
    MLP that must reconstruct the whole sequence, a bottleneck of one ``d_model`` vector. This encoder labels
    tokens, so the reconstruction is written out at answer slots instead: after the compression token come ``n``
    BLANK positions, and the label at the ``j``-th is the ``j``-th token of the sequence.

    Token ids (``vocab_size = vocab + 3``):

    * ``0``: PAD (never used: every sequence is ``2 * num_tokens + 1`` long).
    * ``1 .. vocab``: content, i.i.d. uniform (class ``token - 1``; ``num_classes = vocab``).
    * ``vocab + 1``: COMPRESS (``compress_id``).
    * ``vocab + 2``: BLANK (``blank_id``), the answer slots.

    Layout, ``n = num_tokens``::

        position: 0 .. n-1   | n        | n+1 .. 2n
        token:    x1 ... xn  | COMPRESS | BLANK x n
        label:    -100       | -100     | class of x1 ... xn

    **What it tests here.** A layer whose state is fixed (linear attention, the decay and delta-rule forms, a
    sliding window shorter than ``n``) has to carry all ``n`` tokens past the COMPRESS token in its state, which is
    MAD's bottleneck; softmax attention over the whole sequence can instead read ``x_j`` back by position (the
    slot ``n + 1 + j`` looks ``n + 1`` positions back), so for it this is a positional copy. The labels need only
    the tokens before each slot, and the inputs at the slots are blanks, so no label is an input.

    ``chance_accuracy`` is the bag-of-tokens guess (as :class:`SelectiveCopy`'s): ``E[mode count] / n``, 0.19 at the
    defaults.

    Args:
        num_tokens: tokens to compress, ``n >= 1`` (``seq_len = 2n + 1``).
        vocab: content ids, ``>= 2``.
        **data: batch_size, num_train (default 10,000), num_val, num_test (1,000 each), seed, num_workers,
            resample: see :class:`~attnlab.tasks.base.DataOptions`.

    Batches: ``tokens LongTensor (B, 2n + 1)``, ``labels LongTensor (B, 2n + 1)``.
    """

    per_token = True
    data_defaults = MAD_DEFAULTS
    length_keys = ("num_tokens",)

    def __init__(self, num_tokens: int = 16, vocab: int = 16, **data: Any) -> None:
        super().__init__(**data)
        self.num_tokens = check_int("num_tokens", num_tokens, minimum=1)
        self.vocab = check_int("vocab", vocab, minimum=2)
        self.compress_id: int = self.vocab + 1
        self.blank_id: int = self.vocab + 2
        self.vocab_size = self.vocab + 3
        self.num_classes = self.vocab
        self.seq_len = self.max_len = 2 * self.num_tokens + 1
        self.chance_accuracy = bag_of_tokens_accuracy("sort", self.vocab, self.num_tokens, self.num_tokens)

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` compression sequences: tokens and labels ``(num, 2 * num_tokens + 1)`` (int64)."""
        n = self.num_tokens
        content = rng.integers(0, self.vocab, size=(num, n))
        tokens = np.full((num, self.seq_len), self.blank_id, dtype=np.int64)
        tokens[:, :n] = content + 1
        tokens[:, n] = self.compress_id
        labels = np.full((num, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        labels[:, n + 1 :] = content
        return tokens, labels

    def _describe_details(self) -> str:
        return f"num_tokens={self.num_tokens}, vocab={self.vocab}, chance={self.chance_accuracy:.3f}"


# ------------------------------------------------------------------------------------------------ memorization


@register_task("memorization")
class Memorization(SequenceTask):
    """Memorization (MAD): a fixed map from keys to values, drawn once from ``map_seed``; sequences of keys, and the
    label at each key is its value. No value is ever in the context, so only the weights can hold the map.

    Token ids (``vocab_size = vocab_keys + 1``): ``0`` PAD (never used), ``1 .. vocab_keys`` keys.

    * The map (``mapping``, an ``int64`` array: ``mapping[key - 1]`` is the value class of token ``key``) is
      balanced: each of the ``vocab_values`` classes is the value of ``vocab_keys / vocab_values`` keys (rounded
      down or up), in a random arrangement from ``SeedSequence([map_seed])`` alone. It does not depend on ``seed``
      or the split: train, val and test (and runs of another ``seed``) share it, as MAD's ``kv_map_seed`` does.
    * Each sequence is ``seq_len`` keys, i.i.d. uniform (from the split's stream), and every position is labelled:
      the label at key ``k`` is ``mapping[k - 1]``.
    * MAD writes ``k INSERT`` and labels the INSERT token with the value; here the label sits on the key itself (as
      MQAR labels its queries), so the task isolates what the weights store from moving a token one place on.
      It needs no context at all: the label at a position is a function of the token there.

    ``chance_accuracy`` is the share of the most frequent value class among the keys, ``ceil(vocab_keys /
    vocab_values) / vocab_keys`` (keys are uniform): the best guess that ignores the key (1/16 at the defaults).

    Args:
        vocab_keys: key ids, ``>= vocab_values``.
        vocab_values: value classes (= ``num_classes``), ``>= 2``.
        seq_len: keys per sequence, ``>= 1``.
        map_seed: the seed of the map, ``>= 0`` (independent of ``seed``).
        **data: batch_size, num_train (default 10,000), num_val, num_test (1,000 each), seed, num_workers,
            resample: see :class:`~attnlab.tasks.base.DataOptions`.

    Batches: ``tokens LongTensor (B, seq_len)``, ``labels LongTensor (B, seq_len)``.
    """

    per_token = True
    data_defaults = MAD_DEFAULTS
    length_keys = ("seq_len",)

    def __init__(
        self, vocab_keys: int = 256, vocab_values: int = 16, seq_len: int = 32, map_seed: int = 0, **data: Any
    ) -> None:
        super().__init__(**data)
        self.vocab_values = check_int("vocab_values", vocab_values, minimum=2)
        self.vocab_keys = check_int("vocab_keys", vocab_keys, minimum=self.vocab_values)
        self.map_seed = check_int("map_seed", map_seed, minimum=0)
        self.vocab_size = self.vocab_keys + 1
        self.num_classes = self.vocab_values
        self.seq_len = self.max_len = check_int("seq_len", seq_len, minimum=1)
        map_rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.map_seed])))
        self.mapping: np.ndarray = map_rng.permutation(np.arange(self.vocab_keys) % self.vocab_values).astype(np.int64)
        self.chance_accuracy = math.ceil(self.vocab_keys / self.vocab_values) / self.vocab_keys

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` sequences of keys and their values: tokens and labels ``(num, seq_len)`` (int64)."""
        keys = rng.integers(0, self.vocab_keys, size=(num, self.seq_len))
        return keys + 1, self.mapping[keys]

    def _describe_details(self) -> str:
        return (
            f"vocab_keys={self.vocab_keys} -> vocab_values={self.vocab_values}, map_seed={self.map_seed}, "
            f"chance={self.chance_accuracy:.3f}"
        )
