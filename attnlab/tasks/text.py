"""Byte-level causal language modelling on real English text that ships with Python: ``pydoc_data.topics``.

The standard library's ``pydoc_data.topics.topics`` is a dict of documentation topics (the text that ``help()``
shows for keywords and language topics; 79 topics, 464,970 characters / 466,117 UTF-8 bytes on CPython 3.11).
Nothing is downloaded. The text is prose with code examples, so a model must learn spelling, words and some
Python syntax; a byte-level LM on it is a small, real-data companion to the synthetic tasks.

**Tokens and labels.** The text is read as UTF-8 bytes; token id = byte + 1 (``PAD = 0`` never occurs, every
window is full), ``vocab_size = 257``; the label at position ``t`` is the *next* byte (``num_classes = 256``):
a window of ``L + 1`` consecutive bytes ``b_0 .. b_L`` gives ``tokens = b_0..b_{L-1} + 1`` and
``labels = b_1..b_L``, a target at every position. The model must therefore not see token ``t + 1`` when it
predicts label ``t``: train it with ``mask=causal`` (a bidirectional model reads the answer off the next input).

**Bits per byte vs bits per character.** ``val/bpc`` and ``test/bpc`` are bits per *byte* (cross-entropy in nats
/ ln 2 per target). The text is nearly all ASCII: 1,722 of its 466,117 bytes (0.37%) are non-ASCII, the UTF-8
encodings of 575 characters (curly quotes, dashes, an ellipsis, ``ß``, ``°``). So bits per character = bits per
byte × bytes / characters = bits per byte × 1.0025: the two agree to 0.25%.

**Splits, held out by topic.** The topics repeat one another: ``compound`` contains ``if``, ``for``, ``while``,
``try``, ``with``, ``function`` and ``class`` almost verbatim, ``specialnames`` contains ``customization``,
``attribute-access``, ``numeric-types`` ..., ``execmodel`` contains ``naming`` and ``exceptions``. A plain split by
topic name would leak (with every 10th topic held out, 77% of the 129-byte windows of the validation text occur in
the training text). So topics that share a run of :data:`SHARED_RUN` = 48 bytes are grouped (transitively), and
whole groups are assigned: largest first (ties by name), each to the split furthest below its share (80/10/10) of
the bytes assigned so far. On CPython 3.11 this makes 35 groups (one of 36 topics, which is the training set) and
the splits have 36 / 23 / 20 topics, **381,413 / 42,391 / 42,465 bytes** (train / val / test: 81.8% / 9.1% /
9.1%), each split's topics joined in name order with ``"\\n\\n"``. No 48-byte run of a held-out topic occurs
in a training topic, and no 129-byte window (the default) of the held-out texts occurs anywhere in the training
text (checked in the tests); the topics still share words and phrases (it is one manual). The split depends on the
text alone, not on ``seed``; the seed only picks windows.

**Windows.** ``train``: ``num_train`` windows at uniformly random offsets of the training text, from the split's
seeded stream (with ``resample=True``, the default here, a fresh set of offsets every epoch; the default 3,000
windows of 128 tokens hold about as many bytes as the training text). ``val`` / ``test``: ``num_val`` /
``num_test`` windows at evenly spaced offsets of their text, shifted together by one seeded random phase
(``offset_k = floor(phase + k * stride)``, ``stride = (bytes - L) / num``, ``phase`` uniform in ``[0, stride)``):
the windows tile the held-out text evenly (the default 320 windows of 128 tokens read about 97% of it, each byte
once) and differ between seeds only by where the tiling starts. ``test_lengths`` windows are made the same way
from the test text. Every position of a window is scored, so a byte near a window's start is predicted from
little context: ``bpc`` is the average over context lengths ``0 .. L - 1``.

The text differs between Python versions (the documentation is revised), so numbers are comparable only between
runs on the same Python; ``source_digest`` (in :meth:`describe`) fingerprints the text a run used.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from typing import Any

import numpy as np

from attnlab.checks import check_int
from attnlab.tasks import register_task
from attnlab.tasks.base import SPLITS, DataOptions, SequenceTask

SEPARATOR: bytes = b"\n\n"
"""Joins the topics of a split."""

SHARED_RUN: int = 48
"""Topics that share a run of this many bytes are grouped (transitively) and kept in one split."""

TARGET_SHARES: dict[str, float] = {"train": 0.8, "val": 0.1, "test": 0.1}
"""The share of the bytes that each split aims at."""


def topic_groups(texts: dict[str, bytes], run: int = SHARED_RUN) -> list[tuple[str, ...]]:
    """The topics grouped by shared text: two topics are in one group when a run of ``run`` bytes occurs in both
    (transitively). Groups are sorted tuples of names, in order of their first name."""
    names = sorted(texts)
    parent = list(range(len(names)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[bytes, int] = {}  # run of bytes -> the first topic it occurs in
    for i, name in enumerate(names):
        text = texts[name]
        for j in range(len(text) - run + 1):
            owner = first.setdefault(text[j : j + run], i)
            if owner != i:
                a, b = root(owner), root(i)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[str]] = {}
    for i, name in enumerate(names):
        groups.setdefault(root(i), []).append(name)
    return sorted(tuple(group) for group in groups.values())


def assign_groups(groups: list[tuple[str, ...]], sizes: dict[str, int]) -> dict[str, tuple[str, ...]]:
    """Groups to splits: largest group first (ties by name), each to the split furthest below its share
    (:data:`TARGET_SHARES`) of the bytes assigned so far, this group's included. Returns sorted names per split."""
    size = {group: sum(sizes[name] for name in group) for group in groups}
    assigned = dict.fromkeys(SPLITS, 0)
    names: dict[str, list[str]] = {split: [] for split in SPLITS}
    for group in sorted(groups, key=lambda g: (-size[g], g)):
        total = sum(assigned.values()) + size[group]
        split = max(SPLITS, key=lambda s: TARGET_SHARES[s] * total - assigned[s])
        assigned[split] += size[group]
        names[split].extend(group)
    return {split: tuple(sorted(values)) for split, values in names.items()}


@functools.cache
def split_topics() -> dict[str, tuple[str, ...]]:
    """The topic names of each split, ``{split: sorted names}`` (see the module docstring)."""
    from pydoc_data.topics import topics

    texts = {name: text.encode("utf-8") for name, text in topics.items()}
    splits = assign_groups(topic_groups(texts), {name: len(text) for name, text in texts.items()})
    empty = [split for split in SPLITS if not splits[split]]
    if empty:  # cannot happen with CPython's pydoc_data, whose topics form dozens of groups
        raise RuntimeError(f"pydoc_data.topics forms too few groups of unshared topics to fill {', '.join(empty)}")
    return splits


@functools.cache
def split_text(split: str) -> bytes:
    """The UTF-8 text of ``split``: its topics in name order, joined with :data:`SEPARATOR`."""
    from pydoc_data.topics import topics

    return SEPARATOR.join(topics[name].encode("utf-8") for name in split_topics()[split])


@functools.cache
def _split_bytes(split: str) -> np.ndarray:
    array = np.frombuffer(split_text(split), dtype=np.uint8).astype(np.int64)
    array.setflags(write=False)
    return array


@register_task("text")
class TextLM(SequenceTask):
    """Byte-level causal LM on ``pydoc_data.topics`` (per-token labels: the next byte). See the module docstring.

    Token ids: ``0`` PAD (never used), ``byte + 1`` in ``1..256``; ``vocab_size = 257``. Labels: the next byte,
    ``0..255`` (``num_classes = 256``), at every position.

    Attributes (besides those of :class:`SequenceTask`):
        requires_causal: True: the label at ``t`` is token ``t + 1``, so a mask that lets position ``t`` see a later
            key (``mask=none``, ``sliding_window``) hands the model its answer; only causal masks (``j <= i``:
            ``causal``, ``causal_window``) keep the task honest. A flag for the config check.
        split_bytes: ``{split: number of bytes of its text}``.
        chance_accuracy: accuracy of always predicting the most frequent byte of the training text (the space).
        unigram_bpc: bits per byte, on the test text, of the training text's byte frequencies (add-one smoothed):
            what a model that ignores the context achieves.
        source_digest: first 12 hex digits of the SHA-256 of the three split texts (they vary with the Python version).

    Args:
        seq_len: window length ``L`` (tokens per sequence), ``1 <= L < `` bytes of the smallest split (the test text).
        **data: batch_size (default 16), num_train (3,000), num_val, num_test (320 each), seed, num_workers,
            resample (default True: fresh random training windows every epoch), test_lengths (extra test sets of
            windows of each length, each ``< `` test bytes): see :class:`~attnlab.tasks.base.DataOptions`.

    Batches: ``tokens LongTensor (B, seq_len)``, ``labels LongTensor (B, seq_len)``.
    """

    per_token = True
    data_defaults = DataOptions(batch_size=16, num_train=3000, num_val=320, num_test=320, resample=True)
    length_keys = ("seq_len",)
    reports_bits = True
    requires_causal = True

    def __init__(
        self,
        seq_len: int = 128,
        **data: Any,
    ) -> None:
        super().__init__(**data)
        self.split_bytes: dict[str, int] = {split: len(split_text(split)) for split in SPLITS}
        seq_len = check_int("seq_len", seq_len, minimum=1)
        self.check_length(seq_len, "seq_len")
        self.vocab_size = 257
        self.num_classes = 256
        self.seq_len = seq_len
        self.max_len = seq_len
        train, test = _split_bytes("train"), _split_bytes("test")
        counts = np.bincount(train, minlength=256)
        self.chance_accuracy = float(counts.max() / counts.sum())
        smoothed = (counts + 1) / (counts.sum() + 256)
        self.unigram_bpc = float(-np.log2(smoothed[test]).mean())
        digest = hashlib.sha256(b"\0".join(split_text(split) for split in SPLITS)).hexdigest()
        self.source_digest = digest[:12]
        self.check_test_lengths()

    def check_length(self, length: int, name: str = "test_lengths") -> None:
        """A window of ``length`` tokens needs ``length + 1`` bytes of every split it is cut from (``seq_len``: all
        three; ``test_lengths``: the test text)."""
        splits = SPLITS if name == "seq_len" else ("test",)
        split = min(splits, key=lambda s: self.split_bytes[s])
        longest = self.split_bytes[split] - 1
        if length > longest:
            raise ValueError(
                f"{name} must be <= {longest} (a window needs length + 1 bytes and the {split} text has "
                f"{self.split_bytes[split]}), got {length}"
            )

    # ------------------------------------------------------------------ windows

    @staticmethod
    def windows(data: np.ndarray, offsets: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``data[o : o + length] + 1`` and labels ``data[o + 1 : o + length + 1]`` for each offset ``o``."""
        window = data[offsets[:, None] + np.arange(length + 1)[None, :]]  # (num, length + 1) bytes
        return window[:, :-1] + 1, window[:, 1:].copy()

    @staticmethod
    def tiled_offsets(size: int, num: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """``num`` evenly spaced window offsets over ``size`` bytes with one random phase (see the module docs)."""
        positions = size - length  # valid offsets: 0 .. size - length - 1
        stride = positions / num
        phase = rng.random() * stride
        offsets = np.floor(phase + stride * np.arange(num)).astype(np.int64)
        return np.minimum(offsets, positions - 1)

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``num`` windows of ``split``: random offsets for ``train``, a seeded tiling for ``val`` / ``test``."""
        data = _split_bytes(split)
        if split == "train":
            offsets = rng.integers(0, len(data) - self.seq_len, size=num)
        else:
            offsets = self.tiled_offsets(len(data), num, self.seq_len, rng)
        return self.windows(data, offsets, self.seq_len)

    def generate_length(self, num: int, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``num`` test windows of ``length`` tokens (a seeded tiling of the test text)."""
        self.check_length(length)
        data = _split_bytes("test")
        return self.windows(data, self.tiled_offsets(len(data), num, length, rng), length)

    def probe_vocabulary(self) -> list[int]:
        """The head-type probe's tokens: the bytes that occur in the training text (107 of 256 on CPython 3.11), as
        token ids. A byte the model never saw has an untrained embedding: attention to it says nothing."""
        return sorted((np.unique(_split_bytes("train")) + 1).tolist())

    def decode(self, tokens: np.ndarray | list[int]) -> bytes:
        """The bytes of a row of tokens (PAD dropped)."""
        return bytes(int(t) - 1 for t in np.asarray(tokens).reshape(-1) if int(t) != self.pad_id)

    def _describe_details(self) -> str:
        topics = {split: len(names) for split, names in split_topics().items()}
        parts = "/".join(f"{self.split_bytes[s]:,}" for s in SPLITS)
        counts = "/".join(str(topics[s]) for s in SPLITS)
        return (
            f"bytes of pydoc_data.topics (Python {platform.python_version()}, digest {self.source_digest}), "
            f"train/val/test text = {parts} bytes from {counts} topics, chance_accuracy={self.chance_accuracy:.3f}, "
            f"unigram_bpc={self.unigram_bpc:.3f}"
        )
