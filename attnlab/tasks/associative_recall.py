"""Multi-query associative recall (MQAR), after Zoology (Arora et al., 2023).

A sequence lists ``num_pairs`` key-value pairs, then asks for the values of ``num_queries`` of the keys.
The model must output, at each query, the value that followed that key in the context. Because a key's
value is the token right *after* it, the task is order-sensitive: a bag-of-tokens model cannot solve it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnlab.checks import check_int
from attnlab.tasks import register_task
from attnlab.tasks.base import IGNORE_INDEX, DataOptions, SequenceTask


@register_task("associative_recall")
class AssociativeRecall(SequenceTask):
    """MQAR data module (per-token labels).

    Token ids (``vocab_size = vocab_keys + vocab_values + 2``):

    * ``0``: PAD.
    * ``1 .. vocab_keys``: keys (``key_offset = 1``).
    * ``vocab_keys + 1 .. vocab_keys + vocab_values``: values (``value_offset = vocab_keys + 1``).
    * ``vocab_keys + vocab_values + 1``: FILLER (``filler_id``), used only when ``seq_len`` is larger than
      the minimum ``2 * num_pairs + num_queries``.

    Layout of one sequence, ``n = num_pairs``, ``m = num_queries``, ``S = seq_len``::

        position:  0   1   2   3  ...  2n-2 2n-1 | 2n ... S-1
        token:     k1  v1  k2  v2 ...  kn   vn   | query region
        label:    -100 everywhere in the context  | value class at a query, -100 elsewhere

    * Keys ``k1..kn`` are distinct (drawn without replacement from the key range) and so are the values
      ``v1..vn`` (drawn without replacement from the value range), as in Zoology.
    * The query region has ``S - 2n`` positions. It holds ``m`` distinct context keys, chosen without
      replacement and in random order. With the default ``seq_len`` (``S = 2n + m``) the queries are
      back to back; with a larger ``seq_len`` they sit at sorted, uniformly random distinct positions of
      the region and every other region position holds FILLER (so the recall distance varies).
    * The label at a query position is the class ``v - value_offset`` in ``[0, vocab_values)`` of the value
      ``v`` that followed that key in the context; every other label is ``-100`` (:data:`IGNORE_INDEX`).
    * Values never appear in the query region, so the labels do not leak to a bidirectional model either.
    * Sequences are never padded: all splits have length ``seq_len``.

    With ``fused_pairs=True`` each context pair is one token, ``pair_offset + key * vocab_values + value``
    (``vocab_keys * vocab_values`` extra ids after FILLER), so the context is ``n`` positions long
    (``S >= n + m``) and a single attention layer can answer a query by retrieving, by content, the one pair token
    that holds its key: a sharp-attention lookup without the two-layer induction circuit that the interleaved
    layout needs (which small models take thousands of steps to learn).

    Args:
        num_pairs: key-value pairs in the context, ``n >= 1``.
        num_queries: queries, ``1 <= m <= num_pairs``; ``None`` → ``num_pairs``.
        vocab_keys: size of the key range, ``>= num_pairs``.
        vocab_values: size of the value range (= ``num_classes``), ``>= num_pairs``.
        seq_len: total length ``S >= 2 * num_pairs + num_queries`` (``num_pairs + num_queries`` with fused pairs);
            ``None`` → exactly that minimum.
        fused_pairs: one token per key-value pair (see above).
        resample: a fresh training set every epoch (see :class:`SequenceTask`); ``experiment=mqar`` sets it.
        test_lengths: extra test sets whose ``seq_len`` is each given length (same pairs and queries, more or less
            filler: the recall distance grows with the length); each must be at least the minimum length.
        **data: batch_size, num_train (default 10,000), num_val, num_test (1,000 each), seed, num_workers:
            see :class:`~attnlab.tasks.base.DataOptions`.

    ``chance_accuracy`` is ``1 / num_pairs``: a model that has learnt which values the context holds, but not which
    key each belongs to, guesses among ``num_pairs`` values. The plateau (``train/plateau_steps``) is measured
    from it.

    **Bidirectional attention on the interleaved layout.** With ``mask=causal`` (as Zoology trains, and as
    ``experiment=mqar`` sets) a 2-layer model solves 8 pairs in a few hundred steps. Without a mask the same
    model stays at chance for thousands of steps, although a bidirectional 2-layer solution exists (built by
    hand in ``experiments/mqar``): it is a property of optimisation without the causal mask, not a defect of the
    data, labels or masks; ``experiments/mqar/README.md`` has the evidence.

    Batches: ``tokens LongTensor (B, seq_len)``, ``labels LongTensor (B, seq_len)``.
    """

    per_token = True
    data_defaults = DataOptions(num_train=10_000, num_val=1_000, num_test=1_000)
    length_keys = ("seq_len", "num_pairs")

    def __init__(
        self,
        num_pairs: int = 8,
        num_queries: int | None = None,
        vocab_keys: int = 32,
        vocab_values: int = 32,
        seq_len: int | None = None,
        fused_pairs: bool = False,
        **data: Any,
    ) -> None:
        super().__init__(**data)
        self.num_pairs = check_int("num_pairs", num_pairs, minimum=1)
        if num_queries is None:
            num_queries = self.num_pairs
        self.num_queries = check_int("num_queries", num_queries, minimum=1, maximum=self.num_pairs)
        self.vocab_keys = check_int("vocab_keys", vocab_keys, minimum=self.num_pairs)
        self.vocab_values = check_int("vocab_values", vocab_values, minimum=self.num_pairs)
        self.fused_pairs = bool(fused_pairs)
        self.context_len = self.num_pairs * (1 if self.fused_pairs else 2)
        min_len = self.context_len + self.num_queries
        if seq_len is None:
            seq_len = min_len
        self.min_len = min_len
        seq_len = check_int("seq_len", seq_len)
        self.check_length(seq_len, "seq_len")

        self.key_offset: int = 1
        self.value_offset: int = 1 + self.vocab_keys
        self.filler_id: int = 1 + self.vocab_keys + self.vocab_values
        self.pair_offset: int = self.filler_id + 1
        self.vocab_size = self.vocab_keys + self.vocab_values + 2
        if self.fused_pairs:
            self.vocab_size += self.vocab_keys * self.vocab_values
        self.num_classes = self.vocab_values
        self.seq_len = seq_len
        self.max_len = seq_len
        self.chance_accuracy = 1.0 / self.num_pairs
        self.check_test_lengths()

    def check_length(self, length: int, name: str = "test_lengths") -> None:
        """Sequences must hold the context and the queries: ``length >= min_len``."""
        if length < self.min_len:
            what = "num_pairs" if self.fused_pairs else "2*num_pairs"
            raise ValueError(f"{name} must be >= {what} + num_queries = {self.min_len}, got {length}")

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` MQAR sequences: tokens ``(num, seq_len)`` and labels ``(num, seq_len)`` (int64)."""
        return self.generate_length(num, rng, self.seq_len)

    def generate_length(self, num: int, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``num`` MQAR sequences of ``length`` tokens (the query region filled up with FILLER)."""
        n, m = self.num_pairs, self.num_queries
        c = self.context_len
        region = length - c
        # distinct keys / values per row: the first n columns of a random permutation of each range
        keys = np.argsort(rng.random((num, self.vocab_keys)), axis=1)[:, :n]  # (num, n) in [0, vocab_keys)
        values = np.argsort(rng.random((num, self.vocab_values)), axis=1)[:, :n]  # (num, n) value classes
        queried = np.argsort(rng.random((num, n)), axis=1)[:, :m]  # (num, m) pair indices, random order
        if region == m:
            positions = np.broadcast_to(np.arange(m), (num, m))
        else:
            positions = np.sort(np.argsort(rng.random((num, region)), axis=1)[:, :m], axis=1)

        tokens = np.empty((num, length), dtype=np.int64)
        if self.fused_pairs:
            tokens[:, :n] = self.pair_offset + keys * self.vocab_values + values
        else:
            tokens[:, 0 : 2 * n : 2] = keys + self.key_offset
            tokens[:, 1 : 2 * n : 2] = values + self.value_offset
        labels = np.full((num, length), IGNORE_INDEX, dtype=np.int64)

        query_tokens = np.full((num, region), self.filler_id, dtype=np.int64)
        query_labels = np.full((num, region), IGNORE_INDEX, dtype=np.int64)
        np.put_along_axis(query_tokens, positions, np.take_along_axis(keys, queried, 1) + self.key_offset, 1)
        np.put_along_axis(query_labels, positions, np.take_along_axis(values, queried, 1), 1)
        tokens[:, c:] = query_tokens
        labels[:, c:] = query_labels
        return tokens, labels

    def _describe_details(self) -> str:
        return (
            f"num_pairs={self.num_pairs}, num_queries={self.num_queries}, "
            f"vocab_keys={self.vocab_keys}, vocab_values={self.vocab_values}, fused_pairs={self.fused_pairs}"
        )
