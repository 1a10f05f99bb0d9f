"""Two harder MQARs: recall after overwriting (:class:`ForgettingRecall`) and recall by a two-part key
(:class:`CompositionalRecall`).

Both keep MQAR's rules (:class:`~attnlab.tasks.associative_recall.AssociativeRecall`, Zoology, Arora et al. 2023):
the interleaved layout, per-token labels only at the queries (``-100`` elsewhere), values never in the query region
(so a bidirectional mask leaks nothing), distinct values within a sequence, no padding. ``experiment=forgetting_recall``
trains them as Zoology trains MQAR (causal, a fresh training set every epoch).

* **Forgetting MQAR** (``task=forgetting_recall``): every key is written ``writes_per_key`` times with a new value
  each time, and the query asks for the newest. A state that only adds (linear attention, or a decay that does not
  match the rewrite distance) holds a superposition of a key's values; the delta rule replaces the old value
  (Schlag et al. 2021; Yang et al. 2024, 2025: the "overwrite" property). Zoology's 2026 forgetting variant asks the
  same question; this is attnlab's version of it, laid out below.
* **Compositional MQAR** (``task=compositional_recall``): a key is a pair of tokens ``(a, b)`` from two vocabularies,
  and a sequence's keys are a full ``rows × cols`` grid (every chosen ``a`` with every chosen ``b``), so each part
  occurs in several keys and neither part alone identifies the value: the lookup must bind both parts.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from attnlab.checks import check_int
from attnlab.tasks import register_task
from attnlab.tasks.base import IGNORE_INDEX, DataOptions, SequenceTask, distinct_rows

__all__ = ["CompositionalRecall", "ForgettingRecall"]

RECALL_DEFAULTS = DataOptions(num_train=10_000, num_val=1_000, num_test=1_000)
"""The split sizes of both tasks (as MQAR's)."""


@register_task("forgetting_recall")
class ForgettingRecall(SequenceTask):
    """Forgetting MQAR (per-token labels): keys are reassigned new values during the context; a query asks for the
    newest value of its key.

    Token ids (``vocab_size = vocab_keys + vocab_values + 1``): ``0`` PAD (never used), ``1 .. vocab_keys`` keys
    (``key_offset = 1``), then ``vocab_values`` values (``value_offset = vocab_keys + 1``).

    Layout, ``n = num_keys``, ``w = writes_per_key``, ``m = num_queries``::

        k v k v ... k v  (n·w writes)  |  q1 q2 ... qm
        label: -100 in the context     |  the class of the newest value written under q_j

    * Each sequence draws ``n`` distinct keys and ``n·w`` distinct values. The writes are the multiset of every key
      ``w`` times in a uniformly random order, each with the next of the values, so every key is overwritten
      ``w − 1`` times and its ``w`` values differ: a model that returns an older value is wrong.
    * The query region holds ``m`` distinct keys of the context in random order, back to back; the label at a query
      is ``v − value_offset`` for the value of that key's last write.
    * ``seq_len = 2·n·w + m``; every split has that length.

    ``chance_accuracy`` is ``1 / (n·w)``: a model that knows which values the context holds but not which key has
    which guesses among all of them. :attr:`stale_accuracy` ``= 1/w`` is what a model that recalls a key's values
    but not which is newest scores (MQAR solved, forgetting not).

    Args:
        num_keys: distinct keys a sequence writes, ``n >= 1``.
        writes_per_key: writes of each key, ``w >= 1`` (1 is plain MQAR without filler).
        num_queries: queries, ``1 <= m <= n``; ``None`` → ``n``.
        vocab_keys: size of the key range, ``>= n``.
        vocab_values: size of the value range (= ``num_classes``), ``>= n·w``.
        **data: batch_size, num_train (default 10,000), num_val, num_test (1,000 each), seed, num_workers,
            resample: see :class:`~attnlab.tasks.base.DataOptions`.

    Batches: ``tokens LongTensor (B, seq_len)``, ``labels LongTensor (B, seq_len)``.
    """

    per_token = True
    data_defaults: ClassVar[DataOptions] = RECALL_DEFAULTS
    length_keys = ("num_keys", "writes_per_key", "num_queries")

    def __init__(
        self,
        num_keys: int = 8,
        writes_per_key: int = 2,
        num_queries: int | None = None,
        vocab_keys: int = 32,
        vocab_values: int = 32,
        **data: Any,
    ) -> None:
        super().__init__(**data)
        self.num_keys = check_int("num_keys", num_keys, minimum=1)
        self.writes_per_key = check_int("writes_per_key", writes_per_key, minimum=1)
        self.num_writes = self.num_keys * self.writes_per_key
        self.num_queries = check_int(
            "num_queries", self.num_keys if num_queries is None else num_queries, minimum=1, maximum=self.num_keys
        )
        self.vocab_keys = check_int("vocab_keys", vocab_keys, minimum=self.num_keys)
        self.vocab_values = check_int("vocab_values", vocab_values, minimum=self.num_writes)
        self.key_offset, self.value_offset = 1, 1 + self.vocab_keys
        self.vocab_size = self.vocab_keys + self.vocab_values + 1
        self.num_classes = self.vocab_values
        self.seq_len = self.max_len = 2 * self.num_writes + self.num_queries
        self.chance_accuracy = 1.0 / self.num_writes
        self.stale_accuracy = 1.0 / self.writes_per_key

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` sequences: tokens and labels, both ``(num, seq_len)`` (int64)."""
        n, w, m, c = self.num_keys, self.writes_per_key, self.num_queries, 2 * self.num_writes
        keys = distinct_rows(rng, num, self.vocab_keys, n)  # (num, n) key classes
        values = distinct_rows(rng, num, self.vocab_values, n * w)  # (num, n·w), in write order
        slots = np.argsort(rng.random((num, n * w)), axis=1) % n  # (num, n·w): which key each write sets
        written = np.take_along_axis(keys, slots, 1)  # (num, n·w) key classes in write order
        # the newest value of key slot s: the value at the last write whose slot is s
        last = np.zeros((num, n), dtype=np.int64)
        rows = np.arange(num)
        for t in range(n * w):  # writes in order: a later one replaces an earlier one
            last[rows, slots[:, t]] = t
        newest = np.take_along_axis(values, last, 1)  # (num, n)
        queried = distinct_rows(rng, num, n, m)  # (num, m) key slots, random order

        tokens = np.empty((num, self.seq_len), dtype=np.int64)
        tokens[:, 0:c:2] = written + self.key_offset
        tokens[:, 1:c:2] = values + self.value_offset
        tokens[:, c:] = np.take_along_axis(keys, queried, 1) + self.key_offset
        labels = np.full((num, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        labels[:, c:] = np.take_along_axis(newest, queried, 1)
        return tokens, labels

    def _describe_details(self) -> str:
        return (
            f"num_keys={self.num_keys}, writes_per_key={self.writes_per_key}, num_queries={self.num_queries}, "
            f"vocab_keys={self.vocab_keys}, vocab_values={self.vocab_values}"
        )


@register_task("compositional_recall")
class CompositionalRecall(SequenceTask):
    """Compositional MQAR (per-token labels): two-part keys on a grid, so that no single part identifies a value.

    Token ids (``vocab_size = 2·vocab_parts + vocab_values + 1``): ``0`` PAD (never used), ``1 .. vocab_parts`` first
    parts ``a`` (``a_offset = 1``), the next ``vocab_parts`` second parts ``b`` (``b_offset``), then ``vocab_values``
    values (``value_offset``).

    Layout, ``n = rows · cols`` pairs, ``m = num_queries``::

        a b v  a b v ... (n triples)  |  a b  a b ... (m queries)
        label: -100 in the context     |  -100 at a query's a, the value's class at its b

    * Each sequence draws ``rows`` distinct first parts and ``cols`` distinct second parts, and its keys are every
      pair of them (a full grid) in a uniformly random order, each with its own value (``n`` distinct values). Each
      ``a`` occurs in ``cols`` keys and each ``b`` in ``rows``, so only the pair identifies the value.
    * The query region holds ``m`` distinct context keys in random order; the label sits on the second part of each
      query (the first point where the key is complete).
    * ``seq_len = 3·n + 2·m``; every split has that length.

    ``chance_accuracy`` is ``1/n`` (MQAR's guess among the context's values). :attr:`single_part_accuracy` ``=
    1/min(rows, cols)`` is what a model that looks a value up by one part (the better one) scores.

    Args:
        rows: distinct first parts a sequence uses, ``>= 1``.
        cols: distinct second parts, ``>= 1`` (``rows = cols = 1`` is a single pair; ``2 × 2`` and up compose).
        num_queries: queries, ``1 <= m <= rows·cols``; ``None`` → ``rows·cols``.
        vocab_parts: size of each part's range, ``>= max(rows, cols)``.
        vocab_values: size of the value range (= ``num_classes``), ``>= rows·cols``.
        **data: batch_size, num_train (default 10,000), num_val, num_test (1,000 each), seed, num_workers,
            resample: see :class:`~attnlab.tasks.base.DataOptions`.

    Batches: ``tokens LongTensor (B, seq_len)``, ``labels LongTensor (B, seq_len)``.
    """

    per_token = True
    data_defaults: ClassVar[DataOptions] = RECALL_DEFAULTS
    length_keys = ("rows", "cols", "num_queries")

    def __init__(
        self,
        rows: int = 3,
        cols: int = 3,
        num_queries: int | None = None,
        vocab_parts: int = 16,
        vocab_values: int = 32,
        **data: Any,
    ) -> None:
        super().__init__(**data)
        self.rows = check_int("rows", rows, minimum=1)
        self.cols = check_int("cols", cols, minimum=1)
        self.num_pairs = self.rows * self.cols
        self.num_queries = check_int(
            "num_queries", self.num_pairs if num_queries is None else num_queries, minimum=1, maximum=self.num_pairs
        )
        self.vocab_parts = check_int("vocab_parts", vocab_parts, minimum=max(self.rows, self.cols))
        self.vocab_values = check_int("vocab_values", vocab_values, minimum=self.num_pairs)
        self.a_offset = 1
        self.b_offset = 1 + self.vocab_parts
        self.value_offset = 1 + 2 * self.vocab_parts
        self.vocab_size = 2 * self.vocab_parts + self.vocab_values + 1
        self.num_classes = self.vocab_values
        self.seq_len = self.max_len = 3 * self.num_pairs + 2 * self.num_queries
        self.chance_accuracy = 1.0 / self.num_pairs
        self.single_part_accuracy = 1.0 / min(self.rows, self.cols)

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` sequences: tokens and labels, both ``(num, seq_len)`` (int64)."""
        n, m, c = self.num_pairs, self.num_queries, 3 * self.num_pairs
        a_parts = distinct_rows(rng, num, self.vocab_parts, self.rows)  # (num, rows)
        b_parts = distinct_rows(rng, num, self.vocab_parts, self.cols)  # (num, cols)
        order = distinct_rows(rng, num, n, n)  # (num, n): grid cell of each context pair (cell = r·cols + c)
        a = np.take_along_axis(a_parts, order // self.cols, 1)  # (num, n)
        b = np.take_along_axis(b_parts, order % self.cols, 1)
        values = distinct_rows(rng, num, self.vocab_values, n)  # (num, n), one per context pair
        queried = distinct_rows(rng, num, n, m)  # (num, m) context pair indices, random order

        tokens = np.empty((num, self.seq_len), dtype=np.int64)
        tokens[:, 0:c:3] = a + self.a_offset
        tokens[:, 1:c:3] = b + self.b_offset
        tokens[:, 2:c:3] = values + self.value_offset
        tokens[:, c::2] = np.take_along_axis(a, queried, 1) + self.a_offset
        tokens[:, c + 1 :: 2] = np.take_along_axis(b, queried, 1) + self.b_offset
        labels = np.full((num, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        labels[:, c + 1 :: 2] = np.take_along_axis(values, queried, 1)
        return tokens, labels

    def _describe_details(self) -> str:
        return (
            f"rows={self.rows}, cols={self.cols} ({self.num_pairs} pairs), num_queries={self.num_queries}, "
            f"vocab_parts={self.vocab_parts}, vocab_values={self.vocab_values}"
        )
