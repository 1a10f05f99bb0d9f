"""Handwritten digits as pixel sequences: scikit-learn's bundled ``load_digits`` (no download).

The 1797 images of 8×8 pixels (intensities 0..16) are read in row-major order as sequences of 64 tokens,
``token = intensity + 1`` so that 0 stays PAD, and classified into the digits 0..9. With ``permute=True``
the pixels are put in a fixed, seeded random order (like permuted MNIST), which removes the locality a
convolution-like bias could use.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from attnlab.checks import check_int
from attnlab.tasks import register_task
from attnlab.tasks.base import DataOptions, SequenceTask, split_rng

NUM_IMAGES: int = 1797
NUM_PIXELS: int = 64
MAX_INTENSITY: int = 16
_MIN_SPLIT: int = 10  # a stratified split needs at least one example of each class on each side


@register_task("digits")
class Digits(SequenceTask):
    """sklearn digits, one pixel per token (per-sequence labels, 10 classes).

    Tokens: PAD=0 (never in a sequence: every image has exactly 64 pixels), pixel intensity ``v`` in
    0..16 → token ``v + 1`` in 1..17; ``vocab_size = 18``. ``seq_len = max_len = 64``.

    Splits (all from ``seed``): ``train_test_split(..., stratify=target, random_state=seed)`` first takes
    ``num_test`` images out, then ``num_val`` of the rest; the remaining images, in that split's shuffled
    order, are the training set, truncated to ``num_train`` when it is given. So val/test do not depend on
    ``num_train``. Defaults: 1257/270/270.

    Args:
        permute: apply a fixed pixel permutation drawn from ``seed`` (stored as ``permutation``, shape
            ``(64,)``: token position ``j`` holds pixel ``permutation[j]`` of the row-major image).
        num_train: training images, ``None`` → all the rest (``1797 - num_val - num_test``).
        num_val, num_test: >= 10 each (stratification), with at least 10 images left for training.
        **data: batch_size, seed, num_workers and the sizes above: see :class:`~attnlab.tasks.base.DataOptions`
            (no ``resample`` or ``test_lengths``: a fixed data set).

    Batches: ``tokens LongTensor (B, 64)``, ``labels LongTensor (B,)`` in 0..9.
    """

    per_token = False
    data_defaults = DataOptions(num_train=None, num_val=270, num_test=270)
    no_token_probe = "its tokens are pixel intensities, not a vocabulary"

    def __init__(self, permute: bool = False, **data: Any) -> None:
        super().__init__(**data)
        if not isinstance(permute, (bool, np.bool_)):
            raise ValueError(f"permute must be True or False, got {permute!r}")
        self.permute = bool(permute)
        self.permutation: np.ndarray = (
            split_rng(self.seed, 3).permutation(NUM_PIXELS) if self.permute else np.arange(NUM_PIXELS)
        )
        self.vocab_size = MAX_INTENSITY + 2
        self.num_classes = 10
        self.seq_len = NUM_PIXELS
        self.max_len = NUM_PIXELS

    def check_data(self, options: DataOptions) -> DataOptions:
        """A fixed data set: no ``resample``; ``num_val`` and ``num_test`` at least 10 each (stratification), with
        10 images left for training; ``num_train`` at most what is left (``None``: all of it)."""
        if options.resample:
            raise ValueError("resample=true needs a generated task; digits is a fixed data set (1,797 images)")
        num_val = check_int("num_val", options.num_val, minimum=_MIN_SPLIT)
        num_test = check_int("num_test", options.num_test, minimum=_MIN_SPLIT)
        available = NUM_IMAGES - num_val - num_test
        if available < _MIN_SPLIT:
            raise ValueError(
                f"num_val + num_test must be <= {NUM_IMAGES - _MIN_SPLIT} to leave {_MIN_SPLIT} training "
                f"images, got {num_val} + {num_test} = {num_val + num_test}"
            )
        num_train = available if options.num_train is None else options.num_train
        num_train = check_int("num_train", num_train, minimum=1, maximum=available)
        return super().check_data(replace(options, num_train=num_train, num_val=num_val, num_test=num_test))

    def split_indices(self) -> dict[str, np.ndarray]:
        """Indices into ``load_digits()`` of each split, ``{split: array (N_split,)}``."""
        target = load_digits().target
        index = np.arange(len(target))
        rest, test = train_test_split(index, test_size=self.num_test, stratify=target, random_state=self.seed)
        train, val = train_test_split(rest, test_size=self.num_val, stratify=target[rest], random_state=self.seed)
        return {"train": train[: self.num_train], "val": val, "test": test}

    def build_splits(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Tokens ``(N, 64)`` = permuted pixels + 1 and labels ``(N,)`` of each split."""
        data = load_digits()
        pixels = np.rint(data.data).astype(np.int64)  # (1797, 64), 0..16
        tokens = pixels[:, self.permutation] + 1
        target = data.target.astype(np.int64)
        return {split: (tokens[idx], target[idx]) for split, idx in self.split_indices().items()}

    def _describe_details(self) -> str:
        return f"8x8 sklearn digits as 64 pixel tokens, permute={self.permute}"
