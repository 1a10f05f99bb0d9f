"""Common parts of the synthetic sequence tasks: seeding, splits, padding, data loaders.

Every task is a :class:`lightning.LightningDataModule` that builds its three splits in memory, once,
from ``seed`` alone (nothing is downloaded). Each split is a :class:`torch.utils.data.TensorDataset`
of ``(tokens, labels)``:

* ``tokens``: ``LongTensor (N, L_split)``, right-padded with ``pad_id`` (always 0; token 0 never
  carries content).
* ``labels``: ``LongTensor (N,)`` when ``per_token`` is False (one class per sequence), or
  ``LongTensor (N, L_split)`` when ``per_token`` is True, holding :data:`IGNORE_INDEX` (-100) at every
  position without a target (the default ``ignore_index`` of :func:`torch.nn.functional.cross_entropy`).

Random numbers come from ``numpy.random.Generator(PCG64(SeedSequence([seed, split_index])))``: one
independent stream per split (train=0, val=1, test=2), so the validation and test sets do not change
when ``num_train`` changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from attnlab.checks import check_int

IGNORE_INDEX: int = -100
"""Label at positions without a target (per-token tasks); matches ``cross_entropy``'s default."""

PAD_ID: int = 0
"""Padding token of every task; never used for content."""

SPLITS: tuple[str, str, str] = ("train", "val", "test")
"""Split names, in the order of their seed-stream index."""


def split_rng(seed: int, split_index: int) -> np.random.Generator:
    """The numpy generator of one split: ``Generator(PCG64(SeedSequence([seed, split_index])))``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, split_index])))


def pad_sequences(seqs: Sequence[Sequence[int]], length: int, pad_id: int = PAD_ID) -> np.ndarray:
    """Right-pad variable-length token lists into an ``int64`` array of shape ``(len(seqs), length)``.

    Raises ``ValueError`` if a sequence is longer than ``length``.
    """
    out = np.full((len(seqs), length), pad_id, dtype=np.int64)
    for i, seq in enumerate(seqs):
        if len(seq) > length:
            raise ValueError(f"sequence {i} has length {len(seq)}, longer than the padded length {length}")
        out[i, : len(seq)] = seq
    return out


class SequenceTask(L.LightningDataModule):
    """Base class of the tasks: a data module whose splits are generated in memory from ``seed``.

    Subclasses set the attributes below in ``__init__`` (after calling ``super().__init__``) and
    implement :meth:`generate` (or override :meth:`build_splits` for a fixed data set).

    Attributes:
        name: short task name (the key in :data:`attnlab.tasks.TASKS`).
        vocab_size: number of token ids, PAD included; tokens lie in ``[0, vocab_size)``.
        num_classes: number of target classes; labels lie in ``[0, num_classes)`` (or are -100).
        pad_id: padding token, always 0.
        per_token: True → labels ``(B, L)`` with -100 where there is no target; False → labels ``(B,)``.
        seq_len: length ``L`` of the training sequences (tensors are padded to it).
        max_len: largest ``L`` over all splits (size positional tables with it).
        length_keys: the constructor arguments that set the sequence length (named in config errors).

    Args:
        batch_size: examples per batch, >= 1 (and not more than ``num_train``; checked in ``setup``).
        num_train: training examples, >= 1.
        num_val: validation examples, >= 1.
        num_test: test examples, >= 1.
        seed: non-negative integer; fixes every split and the training shuffle order.
        num_workers: DataLoader worker processes, >= 0.
    """

    name: str = "sequence_task"
    vocab_size: int
    num_classes: int
    pad_id: int = PAD_ID
    per_token: bool
    seq_len: int
    max_len: int
    length_keys: tuple[str, ...] = ()

    def __init__(
        self,
        batch_size: int = 64,
        num_train: int = 1000,
        num_val: int = 200,
        num_test: int = 200,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.num_train = check_int("num_train", num_train, minimum=1)
        self.num_val = check_int("num_val", num_val, minimum=1)
        self.num_test = check_int("num_test", num_test, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self.num_workers = check_int("num_workers", num_workers, minimum=0)
        self._data: dict[str, TensorDataset] = {}

    # ------------------------------------------------------------------ generation (subclass hooks)

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Generate ``num`` examples of ``split`` from ``rng``.

        Returns:
            ``(tokens, labels)`` as integer numpy arrays: tokens ``(num, L_split)`` right-padded with
            ``pad_id``; labels ``(num,)`` or ``(num, L_split)`` (per-token tasks).
        """
        raise NotImplementedError

    def split_size(self, split: str) -> int:
        """Number of examples requested for ``split`` (``"train"``, ``"val"`` or ``"test"``)."""
        return {"train": self.num_train, "val": self.num_val, "test": self.num_test}[split]

    def split_len(self, split: str) -> int:
        """Padded sequence length ``L_split`` of ``split``; ``seq_len`` unless a task overrides it."""
        return self.seq_len

    def build_splits(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """All three splits as ``{split: (tokens, labels)}``, one seeded stream per split."""
        return {
            split: self.generate(split, self.split_size(split), split_rng(self.seed, index))
            for index, split in enumerate(SPLITS)
        }

    # ------------------------------------------------------------------ LightningDataModule API

    def setup(self, stage: str | None = None) -> None:
        """Build all splits once (later calls do nothing)."""
        if self._data:
            return
        if self.batch_size > self.num_train:
            raise ValueError(f"batch_size ({self.batch_size}) is larger than the training set ({self.num_train})")
        data: dict[str, TensorDataset] = {}
        for split, (tokens, labels) in self.build_splits().items():
            data[split] = TensorDataset(*self._to_tensors(split, tokens, labels))
        self._data = data

    def _to_tensors(self, split: str, tokens: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        num, length = self.split_size(split), self.split_len(split)
        if tokens.shape != (num, length):
            raise RuntimeError(f"{self.name}: {split} tokens have shape {tokens.shape}, expected {(num, length)}")
        expected = (num, length) if self.per_token else (num,)
        if labels.shape != expected:
            raise RuntimeError(f"{self.name}: {split} labels have shape {labels.shape}, expected {expected}")
        return torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(labels.astype(np.int64))

    def tensors(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole of ``split`` as ``(tokens (N, L_split), labels (N,) or (N, L_split))``."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        self.setup()
        tokens, labels = self._data[split].tensors
        return tokens, labels

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(
            self._data[split],
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches ``(tokens (B, seq_len), labels)``; order fixed by ``seed``."""
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Test batches in a fixed order (may be longer than ``seq_len``; at most ``max_len``)."""
        return self._loader("test", shuffle=False)

    # ------------------------------------------------------------------ diagnostics

    def probe_batch(self, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` validation examples: ``(tokens (n, L_val), labels (n,) or (n, L_val))``.

        Fixed for a given seed and task settings (it does not depend on ``num_train`` or ``batch_size``).
        """
        n = check_int("n", n, minimum=1, maximum=self.num_val)
        tokens, labels = self.tensors("val")
        return tokens[:n].clone(), labels[:n].clone()

    def describe(self) -> str:
        """One-line summary of the task and its sizes."""
        kind = "per-token" if self.per_token else "per-sequence"
        return (
            f"{self.name}: {self._describe_details()}; vocab_size={self.vocab_size}, "
            f"num_classes={self.num_classes}, {kind}, seq_len={self.seq_len}, max_len={self.max_len}, "
            f"train/val/test={self.num_train}/{self.num_val}/{self.num_test}, seed={self.seed}"
        )

    def _describe_details(self) -> str:
        return ""

    def __repr__(self) -> str:
        try:
            return f"{type(self).__name__}({self.describe()})"
        except AttributeError:  # not fully constructed yet
            return f"{type(self).__name__}(<uninitialised>)"
