"""Common parts of the synthetic sequence tasks: seeding, splits, padding, data loaders.

Every task is a :class:`lightning.LightningDataModule` that builds its three splits in memory, once,
from ``seed`` alone (nothing is downloaded). Each split is a :class:`torch.utils.data.TensorDataset`
of ``(tokens, labels)``:

* ``tokens``: ``LongTensor (N, L_split)``, right-padded with ``pad_id`` (always 0; token 0 never
  carries content).
* ``labels``: ``LongTensor (N,)`` when ``per_token`` is False (one class per sequence), or
  ``LongTensor (N, L_split)`` when ``per_token`` is True, holding :data:`IGNORE_INDEX` (-100) at every
  position without a target (the default ``ignore_index`` of :func:`torch.nn.functional.cross_entropy`).

The eight options every task takes (sizes, seed, loader workers, ``resample``, ``test_lengths``) are one
:class:`DataOptions`: a task's ``__init__`` names only its own arguments and passes the rest on with ``**data``;
its class attribute ``data_defaults`` holds the defaults it differs in. On the command line they stay flat keys of
``task.datamodule`` (``task.datamodule.num_train=500``).

Random numbers come from ``numpy.random.Generator(PCG64(SeedSequence([seed, split_index])))``: one
independent stream per split (train=0, val=1, test=2), so the validation and test sets do not change
when ``num_train`` changes.

Two options are shared by the generated tasks:

* ``resample=True`` draws a fresh training set for every pass over the data (epoch ``e`` from
  ``SeedSequence([seed, 0, e])``), so a model cannot memorise a fixed set; the validation and test sets stay
  fixed. Epoch ``e``'s data depends only on ``seed`` and ``e``, so a resumed run sees what an uninterrupted one
  would. The default ``False`` keeps one fixed training set.
* ``test_lengths=[L1, L2, ...]`` adds one test set of ``num_test`` examples per length (from
  ``SeedSequence([seed, 2, L])``, so adding a length changes no other set): length generalisation. The run
  reports ``test/acc@L`` and ``test/loss@L`` for each, besides ``test/acc`` on the ordinary test split.
  ``max_len`` (which sizes positional tables) covers the longest test length, so a learned table has rows
  there that training never updated: that is the experiment, not an error. Tasks support it by implementing
  :meth:`SequenceTask.generate_length`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Generic, TypeVar

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from attnlab.checks import check_int

IGNORE_INDEX: int = -100
"""Label at positions without a target (per-token tasks); matches ``cross_entropy``'s default."""

PAD_ID: int = 0
"""Padding token of every task; never used for content."""

SPLITS: tuple[str, str, str] = ("train", "val", "test")
"""Split names, in the order of their seed-stream index."""

T = TypeVar("T")


@dataclass(frozen=True)
class DataOptions:
    """The data options every task takes, besides its own: flat keys of ``task.datamodule`` in a config.

    A task's defaults are its class attribute ``data_defaults`` (a ``DataOptions``); what its constructor gets
    replaces them, and :meth:`SequenceTask.check_data` checks the result. A built task keeps it as
    ``task.data_options`` and shows each field as a read-only attribute (``task.num_train``).

    Attributes:
        batch_size: examples per batch, >= 1 (and not more than ``num_train``; checked in ``setup``).
        num_train: training examples, >= 1 (``None``: the task decides, if it can, e.g. all that is left).
        num_val: validation examples, >= 1.
        num_test: test examples, >= 1.
        seed: non-negative integer; fixes every split and the training shuffle order.
        num_workers: DataLoader worker processes, >= 0.
        resample: a fresh training set every epoch (see the module docstring).
        test_lengths: extra test sets, one per length (see the module docstring); a tuple once checked.
    """

    batch_size: int = 64
    num_train: int | None = 1000
    num_val: int = 200
    num_test: int = 200
    seed: int = 0
    num_workers: int = 0
    resample: bool = False
    test_lengths: Sequence[int] | None = None


DATA_KEYS: tuple[str, ...] = tuple(f.name for f in fields(DataOptions))
"""The names of the :class:`DataOptions` fields, in order."""


class _Option(Generic[T]):
    """A read-only task attribute that shows one field of ``task.data_options``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, task: Any, owner: type | None = None) -> T:
        if task is None:
            return self  # type: ignore[return-value]
        return getattr(task.data_options, self.name)

    def __set__(self, task: Any, value: T) -> None:
        raise AttributeError(f"{self.name} is read-only: it is task.data_options.{self.name} (a DataOptions)")


def task_options(cls: type) -> list[str]:
    """Every keyword a task class takes: its own ``__init__`` arguments (through each ``**kwargs`` up to
    :class:`SequenceTask`), then the :class:`DataOptions` fields."""
    own: list[str] = []
    for klass in cls.__mro__:
        if klass is SequenceTask or not issubclass(klass, SequenceTask):
            break
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        own += [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):  # passes nothing on
            return list(dict.fromkeys(own))
    return list(dict.fromkeys([*own, *DATA_KEYS]))


def split_rng(seed: int, split_index: int, *more: int) -> np.random.Generator:
    """The numpy generator of one split: ``Generator(PCG64(SeedSequence([seed, split_index, *more])))`` (``more``:
    the epoch of a resampled training set, the length of a length-generalisation test set)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, split_index, *more])))


def distinct_rows(rng: np.random.Generator, num: int, vocab: int, k: int) -> np.ndarray:
    """``(num, k)`` classes in ``[0, vocab)``, distinct within each row, each row a uniform random draw (the first
    ``k`` columns of a random permutation of ``range(vocab)`` per row)."""
    return np.argsort(rng.random((num, vocab)), axis=1)[:, :k]


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


class EpochSampler(RandomSampler):
    """The training sampler of a ``resample`` task: a random order (from the loader's generator) whose
    ``set_epoch`` (called by Lightning at the start of every pass, resumed passes included) swaps in that
    epoch's training data."""

    def __init__(self, dataset: TensorDataset, task: SequenceTask, generator: torch.Generator | None) -> None:
        super().__init__(dataset, generator=generator)
        self.task = task

    def set_epoch(self, epoch: int) -> None:
        self.task.set_epoch(epoch)


class SequenceTask(L.LightningDataModule):
    """Base class of the tasks: a data module whose splits are generated in memory from ``seed``.

    Subclasses take their own arguments in ``__init__`` and pass the others (the :class:`DataOptions`) on:
    ``def __init__(self, vocab: int = 16, **data: Any)`` calling ``super().__init__(**data)`` first; then they set
    the attributes below and implement :meth:`generate` (or override :meth:`build_splits` for a fixed data set).
    A task whose :meth:`check_length` needs its own attributes calls :meth:`check_test_lengths` at the end of its
    ``__init__``. :func:`attnlab.register_task` makes a task selectable by name (``task=<name>``).

    Attributes:
        name: short task name, set by :func:`attnlab.register_task` (the key in :func:`attnlab.list_tasks`).
        vocab_size: number of token ids, PAD included; tokens lie in ``[0, vocab_size)``.
        num_classes: number of target classes; labels lie in ``[0, num_classes)`` (or are -100).
        pad_id: padding token, always 0.
        per_token: True → labels ``(B, L)`` with -100 where there is no target; False → labels ``(B,)``.
        seq_len: length ``L`` of the training sequences (tensors are padded to it).
        max_len: largest ``L`` over all splits (size positional tables with it).
        length_keys: the constructor arguments that set the sequence length (named in config errors).
        data_defaults: the :class:`DataOptions` this task defaults to (class attribute).
        data_options: the checked :class:`DataOptions` of this task; ``batch_size``, ``num_train``, ``num_val``,
            ``num_test``, ``seed``, ``num_workers``, ``resample`` and ``test_lengths`` read its fields.

    Args:
        **data: fields of :class:`DataOptions` (``batch_size``, ``num_train``, ...), over ``data_defaults``.
    """

    name: str = "sequence_task"
    vocab_size: int
    num_classes: int
    pad_id: int = PAD_ID
    per_token: bool
    seq_len: int
    max_len: int
    length_keys: tuple[str, ...] = ()

    chance_accuracy: float | None = None
    """Accuracy of the best guess that ignores what the task tests (``None`` → ``1 / num_classes``); the end of
    the plateau (``train/plateau_steps``) is measured from it."""
    reports_bits: bool = False
    """Language-modelling tasks: the run also reports ``val/bpc`` and ``test/bpc`` (bits per token)."""
    requires_causal: bool = False
    """The label at a position is a later input token (language modelling): a run with a mask that lets a position
    see a later key is refused before it starts."""

    no_token_probe: ClassVar[str | None] = None
    """Why the head-type scores' repeated-token probe (:meth:`repeated_probe`) does not apply to this task (its tokens
    are not a vocabulary: pixel intensities), or None when it does."""

    data_defaults: ClassVar[DataOptions] = DataOptions()

    @classmethod
    def headline_metric(cls, test_lengths: Sequence[int] | None = None, **options: Any) -> str:
        """The one metric that a comparison on this task is read by (the dashboard's headline and "who wins", the
        results table at the end of a run): the task's usual test metric, ``test/bpc`` for a language-modelling
        task (:attr:`reports_bits`), else ``test/acc``; at the test length :meth:`headline_length` picks
        (``test/acc@256``) where it picks one.

        A class method: a reader of run folders (the dashboard) asks it from the task's name and the run's config
        (``test_lengths`` and the other ``task.datamodule`` options as ``options``) without building the task; a
        built task answers the same for ``task.headline_metric(task.test_lengths)``."""
        base = "test/bpc" if cls.reports_bits else "test/acc"
        lengths = tuple(int(n) for n in test_lengths or ())
        length = cls.headline_length(lengths, **options) if lengths else None
        return base if length is None else f"{base}@{length}"

    @classmethod
    def headline_length(cls, test_lengths: tuple[int, ...], **options: Any) -> int | None:
        """Which of ``test_lengths`` (never empty here) the headline metric is read at, or None for the ordinary
        test split (the default: the extra lengths are a length-generalisation chart, not the result).

        The hook for a task whose result *is* a length: the state-tracking tasks take the longest (what they test
        is tracking beyond the training length), and a needle task can return its effective length here, computed
        from its own ``options`` (the ``task.datamodule`` keys of the run's config)."""
        return None

    batch_size: _Option[int] = _Option()
    num_train: _Option[int] = _Option()
    num_val: _Option[int] = _Option()
    num_test: _Option[int] = _Option()
    seed: _Option[int] = _Option()
    num_workers: _Option[int] = _Option()
    resample: _Option[bool] = _Option()
    test_lengths: _Option[tuple[int, ...]] = _Option()

    def __init__(self, **data: Any) -> None:
        super().__init__()
        for key in data:
            if key not in DATA_KEYS:
                allowed = ", ".join(task_options(type(self)))
                raise ValueError(f"task '{self.name}' does not take parameter '{key}'; allowed: {allowed}")
        self.data_options: DataOptions = self.check_data(replace(self.data_defaults, **data))
        self._data: dict[str, TensorDataset] = {}
        self._length_data: dict[int, TensorDataset] = {}
        self._train_epoch: int | None = None

    def check_data(self, options: DataOptions) -> DataOptions:
        """``options`` checked (one-line ``ValueError`` naming the field) and normalised (``test_lengths`` a
        tuple). Runs in :meth:`__init__` before the subclass sets anything; a task that needs other rules (a
        fixed data set's sizes) overrides it and calls ``super().check_data``."""
        minimum = {"seed": 0, "num_workers": 0}
        checked: dict[str, Any] = {
            key: check_int(key, getattr(options, key), minimum=minimum.get(key, 1))
            for key in ("batch_size", "num_train", "num_val", "num_test", "seed", "num_workers")
        }
        resample, test_lengths = bool(options.resample), self._check_test_lengths(options.test_lengths)
        return replace(options, **checked, resample=resample, test_lengths=test_lengths)

    def check_test_lengths(self) -> None:
        """:meth:`check_length` on every one of ``test_lengths``; a task whose length rule needs its own attributes
        calls it at the end of its ``__init__``, so that a bad length is refused before training."""
        for length in self.test_lengths:
            self.check_length(length)

    def _check_test_lengths(self, test_lengths: Sequence[int] | None) -> tuple[int, ...]:
        if isinstance(test_lengths, (str, int, float)):
            raise ValueError(f"test_lengths must be a list of lengths, e.g. [32, 64, 128], got {test_lengths!r}")
        if test_lengths is None or len(test_lengths) == 0:
            return ()
        if type(self).generate_length is SequenceTask.generate_length:
            raise ValueError(f"task {self.name} does not support test_lengths (it has no length-generalisation split)")
        lengths = [check_int("test_lengths[]", length, minimum=1) for length in test_lengths]
        if len(set(lengths)) != len(lengths):
            raise ValueError(f"test_lengths has a length twice: {lengths}")
        return tuple(lengths)

    @property
    def max_len(self) -> int:
        """Largest sequence length over all splits, test lengths included (size positional tables with it)."""
        return max((self._max_len, *self.test_lengths))

    @max_len.setter
    def max_len(self, value: int) -> None:
        self._max_len = value

    # ------------------------------------------------------------------ generation (subclass hooks)

    def generate(self, split: str, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Generate ``num`` examples of ``split`` from ``rng``.

        Returns:
            ``(tokens, labels)`` as integer numpy arrays: tokens ``(num, L_split)`` right-padded with
            ``pad_id``; labels ``(num,)`` or ``(num, L_split)`` (per-token tasks).
        """
        raise NotImplementedError

    def generate_length(self, num: int, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``num`` test examples of (padded) length ``length``, for ``test_lengths``: tokens ``(num, length)`` and
        labels ``(num,)`` or ``(num, length)``. Tasks that support length generalisation implement it (and raise
        ``ValueError`` naming the allowed lengths for one they cannot make)."""
        raise NotImplementedError

    def check_length(self, length: int) -> None:
        """Raise ``ValueError`` if the task cannot make test sequences of ``length``; a task calls it from its
        ``__init__`` for every entry of ``test_lengths``, so a bad length is refused before training. The default
        accepts every length."""

    def split_size(self, split: str) -> int:
        """Number of examples requested for ``split`` (``"train"``, ``"val"`` or ``"test"``)."""
        return {"train": self.num_train, "val": self.num_val, "test": self.num_test}[split]

    def split_len(self, split: str) -> int:
        """Padded sequence length ``L_split`` of ``split``; ``seq_len`` unless a task overrides it."""
        return self.seq_len

    def build_splits(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """All three splits as ``{split: (tokens, labels)}``, one seeded stream per split (with ``resample``, the
        training set is epoch 0's)."""
        return {
            split: self.generate(split, self.split_size(split), self._rng(index)) for index, split in enumerate(SPLITS)
        }

    def _rng(self, index: int) -> np.random.Generator:
        return split_rng(self.seed, 0, 0) if index == 0 and self.resample else split_rng(self.seed, index)

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
        self._length_data = {}
        for length in self.test_lengths:
            tokens, labels = self.generate_length(self.num_test, split_rng(self.seed, 2, length), length)
            self._length_data[length] = TensorDataset(*self._to_tensors("test", tokens, labels, length))
        self._data = data
        self._train_epoch = 0 if self.resample else None

    def set_epoch(self, epoch: int) -> None:
        """With ``resample``, make the training set that of ``epoch`` (drawn from ``SeedSequence([seed, 0, epoch])``)
        in place; called by the training sampler at the start of every pass. A no-op without ``resample``."""
        if not self.resample or epoch == self._train_epoch:
            return
        self.setup()
        generated = self.generate("train", self.num_train, split_rng(self.seed, 0, epoch))
        tokens, labels = self._to_tensors("train", *generated)
        dataset = self._data["train"]
        dataset.tensors[0].copy_(tokens)
        dataset.tensors[1].copy_(labels)
        self._train_epoch = epoch

    def _to_tensors(
        self, split: str, tokens: np.ndarray, labels: np.ndarray, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num, length = self.split_size(split), length or self.split_len(split)
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

    def _loader(self, dataset: TensorDataset, shuffle: bool) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        sampler = EpochSampler(dataset, self, generator) if shuffle and self.resample else None
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle if sampler is None else None,
            sampler=sampler,
            generator=generator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches ``(tokens (B, seq_len), labels)``; order fixed by ``seed`` (with ``resample``,
        a new set each epoch: see :meth:`set_epoch`)."""
        self.setup()
        trainer = getattr(self, "trainer", None)
        if self.resample and trainer is not None and trainer.world_size > 1:
            raise ValueError("resample=true needs a single training process (its per-epoch data follows one sampler)")
        if self.resample and self.num_workers > 0:
            raise ValueError("resample=true needs num_workers=0 (worker processes would keep the first epoch's data)")
        return self._loader(self._data["train"], shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        self.setup()
        return self._loader(self._data["val"], shuffle=False)

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        """Test batches in a fixed order (may be longer than ``seq_len``; at most ``max_len``). With
        ``test_lengths``, a list: the test split, then one loader per test length, in the order given."""
        self.setup()
        test = self._loader(self._data["test"], shuffle=False)
        if not self.test_lengths:
            return test
        return [test, *(self._loader(self._length_data[length], shuffle=False) for length in self.test_lengths)]

    def length_tensors(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The test set of one of ``test_lengths``: ``(tokens (num_test, length), labels)``."""
        self.setup()
        if length not in self._length_data:
            raise ValueError(f"{length} is not one of test_lengths {list(self.test_lengths)}")
        return self._length_data[length].tensors

    # ------------------------------------------------------------------ diagnostics

    def probe_batch(self, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` validation examples: ``(tokens (n, L_val), labels (n,) or (n, L_val))``.

        Fixed for a given seed and task settings (it does not depend on ``num_train`` or ``batch_size``).
        """
        n = check_int("n", n, minimum=1, maximum=self.num_val)
        tokens, labels = self.tensors("val")
        return tokens[:n].clone(), labels[:n].clone()

    def repeated_probe(self, n: int = 8, seed: int | None = None) -> torch.Tensor | None:
        """The head-type scores' probe (:func:`attnlab.heads.repeated_tokens`): ``n`` sequences ``[x; x]`` of
        ``seq_len // 2`` random tokens of :meth:`probe_vocabulary` each, (n, 2·(seq_len // 2)), drawn from ``seed``
        (default the task's); None for a task whose tokens are not a vocabulary (:attr:`no_token_probe`)."""
        if self.no_token_probe is not None:
            return None
        from attnlab.heads import repeated_tokens

        n = check_int("n", n, minimum=1)
        half = max(2, self.seq_len // 2)
        generator = torch.Generator().manual_seed(self.seed if seed is None else seed)
        return repeated_tokens(n, half, self.probe_vocabulary(), generator)

    def probe_vocabulary(self) -> list[int]:
        """The token ids :meth:`repeated_probe` draws from: every id but padding. A task whose vocabulary holds ids its
        data never uses overrides it (a byte-level LM: the bytes of its training text), since a model's attention to
        a token it never saw says nothing."""
        return [t for t in range(self.vocab_size) if t != self.pad_id]

    def describe(self) -> str:
        """One-line summary of the task and its sizes."""
        kind = "per-token" if self.per_token else "per-sequence"
        extra = ", resampled each epoch" if self.resample else ""
        if self.test_lengths:
            extra += f", test_lengths={list(self.test_lengths)}"
        return (
            f"{self.name}: {self._describe_details()}; vocab_size={self.vocab_size}, "
            f"num_classes={self.num_classes}, {kind}, seq_len={self.seq_len}, max_len={self.max_len}, "
            f"train/val/test={self.num_train}/{self.num_val}/{self.num_test}{extra}, seed={self.seed}"
        )

    def _describe_details(self) -> str:
        return ""

    def __repr__(self) -> str:
        try:
            return f"{type(self).__name__}({self.describe()})"
        except AttributeError:  # not fully constructed yet
            return f"{type(self).__name__}(<uninitialised>)"
