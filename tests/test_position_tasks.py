"""Tests of the position-sensitive tasks (attnlab.tasks.position): Shift, Reverse and Sort.

Labels are checked by plain reference code (loops over the generated tokens), the chance levels by exact enumeration
of every sequence of a tiny vocabulary, and the premise of the "no positions → bag-of-tokens guess" argument on the
encoder itself (permuting the positions permutes the outputs).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import helpers
import numpy as np
import pytest
import torch
from helpers import read_summary, run_train
from hydra import compose
from hydra.utils import instantiate

from attnlab.encoder import Encoder
from attnlab.tasks import IGNORE_INDEX, Reverse, Shift, Sort, build_task, list_tasks, task_class
from attnlab.tasks.base import split_rng
from attnlab.tasks.position import PositionTask

SPLITS = ("train", "val", "test")
NAMES = tuple(n for n in list_tasks() if issubclass(task_class(n), PositionTask))  # shift, reverse, sort
SMALL: dict[str, Any] = dict(num_train=200, num_val=100, num_test=100, batch_size=16)


small = functools.partial(helpers.small, sizes=SMALL)  # small(name, **kwargs): a set-up PositionTask


# ---------------------------------------------------------------- independent reference labels


def reference_labels(name: str, tokens: list[int], offset: int = 1) -> list[int]:
    """The labels of one padded row, by plain loops (class = token - 1, -100 at PAD and where there is no target)."""
    n = 0
    while n < len(tokens) and tokens[n] != 0:
        n += 1
    labels = [IGNORE_INDEX] * len(tokens)
    if name == "shift":
        for i in range(n):
            if i - offset >= 0:
                labels[i] = tokens[i - offset] - 1
    elif name == "reverse":
        for i in range(n):
            labels[i] = tokens[n - 1 - i] - 1
    elif name == "sort":
        content = tokens[:n]
        for i in range(n):
            # the i-th smallest: the value v with #{< v} <= i < #{<= v}
            for v in range(1, max(content) + 1):
                below = sum(1 for t in content if t < v)
                upto = sum(1 for t in content if t <= v)
                if below <= i < upto:
                    labels[i] = v - 1
    else:
        raise AssertionError(name)
    return labels


def check_rows(name: str, tokens: torch.Tensor, labels: torch.Tensor, vocab: int, offset: int = 1) -> list[int]:
    """Assert every row's labels equal the reference and the row is right-padded content; return the true lengths."""
    lengths = []
    for row, row_labels in zip(tokens.tolist(), labels.tolist(), strict=True):
        n = sum(1 for t in row if t != 0)
        assert all(t != 0 for t in row[:n]) and all(t == 0 for t in row[n:]), f"not right-padded: {row}"
        assert all(1 <= t <= vocab for t in row[:n])
        assert row_labels == reference_labels(name, row, offset), (row, row_labels)
        lengths.append(n)
    return lengths


@pytest.mark.parametrize("name", NAMES)
def test_labels_match_the_reference_on_every_split(name: str) -> None:
    task = small(name, vocab=6, seq_len=12)
    assert task.min_length == task.shortest == (2 if name == "shift" else 1)
    for split in SPLITS:
        tokens, labels = task.tensors(split)
        assert tokens.shape == labels.shape == (task.split_size(split), 12)
        lengths = check_rows(name, tokens, labels, vocab=6)
        assert min(lengths) == task.min_length and max(lengths) == 12, "true lengths do not cover the range"


def test_shift_with_a_larger_offset() -> None:
    task = small("shift", offset=3, vocab=5, seq_len=10, min_length=4)
    for split in SPLITS:
        tokens, labels = task.tensors(split)
        lengths = check_rows("shift", tokens, labels, vocab=5, offset=3)
        assert min(lengths) >= 4
        assert (labels[:, :3] == IGNORE_INDEX).all()


@pytest.mark.parametrize("name", NAMES)
def test_fixed_length_has_no_padding(name: str) -> None:
    task = small(name, seq_len=9, min_length=9)
    tokens, labels = task.tensors("train")
    assert (tokens != 0).all()
    check_rows(name, tokens, labels, vocab=16)


def test_docstring_example_rows() -> None:
    row = [3, 9, 9, 1, 4, 0, 0]
    assert reference_labels("shift", row) == [-100, 2, 8, 8, 0, -100, -100]
    assert reference_labels("reverse", row) == [3, 0, 8, 8, 2, -100, -100]
    assert reference_labels("sort", row) == [0, 2, 3, 8, 8, -100, -100]
    tokens = np.array([row])
    lengths, content = np.array([5]), tokens != 0
    for cls in (Shift, Reverse, Sort):
        task = cls(vocab=9, seq_len=7)
        assert task.labels_for(tokens.copy(), lengths, content).tolist() == [reference_labels(cls.name, row)]


# ---------------------------------------------------------------- attributes, shapes, registry


@pytest.mark.parametrize("name", NAMES)
def test_attributes(name: str) -> None:
    task = task_class(name)()
    assert task.name == name and task.per_token
    assert (task.vocab, task.seq_len, task.vocab_size, task.num_classes) == (16, 32, 17, 16)
    assert task.max_len == task.seq_len == 32 and task.pad_id == 0
    assert task.length_keys[0] == "seq_len"
    assert 1 / 16 < task.chance_accuracy < 0.25
    assert name in task.describe() and "\n" not in task.describe()
    assert isinstance(build_task(name, vocab=4), task_class(name))


@pytest.mark.parametrize("name", NAMES)
def test_dataloaders_and_every_sequence_has_a_target(name: str) -> None:
    task = small(name)
    tokens, labels = next(iter(task.train_dataloader()))
    assert tokens.shape == labels.shape == (16, 32) and tokens.dtype == labels.dtype == torch.long
    for split in SPLITS:
        tokens, labels = task.tensors(split)
        target = labels != IGNORE_INDEX
        assert target.any(dim=1).all()
        assert not (target & (tokens == 0)).any()
        assert labels[target].min() >= 0 and labels[target].max() < task.num_classes


@pytest.mark.parametrize("name", NAMES)
def test_ten_thousand_sequences_generate_fast(name: str) -> None:
    task = task_class(name)()
    start = time.perf_counter()
    tokens, labels = task.generate("train", 10_000, split_rng(0, 0))
    assert time.perf_counter() - start < 1.0
    assert tokens.shape == labels.shape == (10_000, 32)


def test_hydra_configs_build_the_tasks(hydra_ctx: None) -> None:
    for name, cls in (("shift", Shift), ("reverse", Reverse), ("sort", Sort)):
        cfg = compose(config_name="config", overrides=[f"task={name}", "batch_size=8", "seed=3"])
        assert cfg.task.name == name
        task = instantiate(cfg.task.datamodule)
        assert type(task) is cls
        assert (task.batch_size, task.seed, task.resample, task.test_lengths) == (8, 3, False, ())


# ---------------------------------------------------------------- determinism, resample


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_data_other_seed_differs(name: str) -> None:
    a, b, c = small(name, seed=4), small(name, seed=4), small(name, seed=5)
    for split in SPLITS:
        for x, y in zip(a.tensors(split), b.tensors(split), strict=True):
            assert torch.equal(x, y)
        assert not torch.equal(a.tensors(split)[0], c.tensors(split)[0])


@pytest.mark.parametrize("name", NAMES)
def test_resample_draws_new_training_data_per_epoch(name: str) -> None:
    a, b = small(name, resample=True), small(name, resample=True)
    val, test = a.tensors("val")[0].clone(), a.tensors("test")[0].clone()
    seen = []
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        tokens, labels = a.tensors("train")
        assert torch.equal(tokens, b.tensors("train")[0]) and torch.equal(labels, b.tensors("train")[1])
        check_rows(name, tokens, labels, vocab=16)
        seen.append(tokens.clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
    a.set_epoch(1)
    assert torch.equal(a.tensors("train")[0], seen[1])
    assert torch.equal(a.tensors("val")[0], val) and torch.equal(a.tensors("test")[0], test)
    fixed = small(name)
    fixed.set_epoch(1)  # a no-op without resample
    assert torch.equal(fixed.tensors("train")[0], small(name).tensors("train")[0])


# ---------------------------------------------------------------- length generalisation


@pytest.mark.parametrize("name", NAMES)
def test_test_lengths_are_exact_unpadded_lengths(name: str) -> None:
    task = small(name, seq_len=16, test_lengths=[16, 40, 5])
    assert task.test_lengths == (16, 40, 5) and task.max_len == 40 and task.seq_len == 16
    loaders = task.test_dataloader()
    assert isinstance(loaders, list) and len(loaders) == 4
    for length in (16, 40, 5):
        tokens, labels = task.length_tensors(length)
        assert tokens.shape == labels.shape == (100, length)
        assert (tokens != 0).all(), "test-length sequences are not padded"
        check_rows(name, tokens, labels, vocab=16)
    assert task.tensors("test")[0].shape == (100, 16)
    again = small(name, seq_len=16, test_lengths=[40])
    assert torch.equal(again.length_tensors(40)[0], task.length_tensors(40)[0])


# ---------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("shift", dict(offset=0), "offset must be an integer >= 1, got 0"),
        ("shift", dict(offset=1.5), "offset must be an integer >= 1, got 1.5"),
        ("shift", dict(offset=4, seq_len=4), "seq_len must be >= offset + 1 = 5"),
        ("shift", dict(min_length=1), "min_length must be >= offset + 1 = 2"),
        ("shift", dict(offset=2, test_lengths=[8, 2]), "test_lengths must be >= offset + 1 = 3"),
        ("reverse", dict(vocab=1), "vocab must be an integer >= 2, got 1"),
        ("reverse", dict(vocab=True), "vocab must be an integer >= 2, got True"),
        ("reverse", dict(seq_len=0), "seq_len must be an integer >= 1, got 0"),
        ("sort", dict(min_length=0), "min_length must be an integer >= 1, got 0"),
        ("sort", dict(seq_len=8, min_length=9), "min_length must be <= seq_len = 8, got 9"),
        ("sort", dict(test_lengths=[0]), "test_lengths[] must be an integer >= 1, got 0"),
        ("sort", dict(test_lengths="64"), "test_lengths must be a list of lengths"),
        ("sort", dict(test_lengths=[8, 8]), "test_lengths has a length twice"),
        ("reverse", dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_give_one_line_errors(name: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        task_class(name)(**kwargs)
    text = str(info.value)
    assert message in text and "\n" not in text, text


# ---------------------------------------------------------------- chance: the best permutation-equivariant guess


def exact_bag_of_tokens_accuracy(name: str, vocab: int, lengths: range, offset: int = 1) -> float:
    """Enumerate every sequence of every length (lengths equally likely, tokens uniform): the best guess that sees
    only (token at i, multiset of the sequence) predicts, for each such key, its most frequent label."""
    correct = labelled = 0.0
    for n in lengths:
        weight = 1.0 / vocab**n  # each sequence of length n; each length equally likely
        table: dict[tuple[int, tuple[int, ...]], Counter] = defaultdict(Counter)
        for seq in itertools.product(range(1, vocab + 1), repeat=n):
            bag = tuple(sorted(seq))
            for i, label in enumerate(reference_labels(name, list(seq), offset)):
                if label != IGNORE_INDEX:
                    table[(seq[i], bag)][label] += 1
        correct += weight * sum(max(counts.values()) for counts in table.values())
        labelled += weight * sum(sum(counts.values()) for counts in table.values())
    return correct / labelled


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("shift", dict(vocab=3, seq_len=6)),
        ("shift", dict(vocab=3, seq_len=7, min_length=5, offset=2)),
        ("reverse", dict(vocab=3, seq_len=6)),
        ("reverse", dict(vocab=4, seq_len=5, min_length=5)),
        ("sort", dict(vocab=3, seq_len=6)),
        ("sort", dict(vocab=4, seq_len=6, min_length=6)),
        # vocab > seq_len: the estimate works on sorted tokens rather than per-token counts
        ("shift", dict(vocab=6, seq_len=5)),
        ("reverse", dict(vocab=6, seq_len=4)),
        ("sort", dict(vocab=7, seq_len=4, min_length=2)),
    ],
)
def test_chance_accuracy_is_the_best_bag_of_tokens_guess(name: str, kwargs: dict[str, Any]) -> None:
    task = task_class(name)(**kwargs)
    exact = exact_bag_of_tokens_accuracy(
        name, task.vocab, range(task.min_length, task.seq_len + 1), getattr(task, "offset", 1)
    )
    assert task.chance_accuracy == pytest.approx(exact, abs=0.006), (task.chance_accuracy, exact)


# ---------------------------------------------------------------- the premise: no positions → equivariance


def encoder_outputs(encoder: Encoder, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return encoder(tokens)


@pytest.mark.parametrize(
    "options",
    [
        dict(pos_encoding="none"),  # plain scaled_dot, no positions
        dict(pos_encoding="none", score="relative_position", score_params={"clip": 0}),  # Shaw with clip 0
    ],
)
def test_an_encoder_without_positions_is_permutation_equivariant(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    encoder = Encoder(17, 32, 2, 1, pad_id=0, **options).double().eval()
    task = small("sort")
    tokens = task.tensors("val")[0][:8]  # variable lengths, right-padded
    out = encoder_outputs(encoder, tokens)
    generator = torch.Generator().manual_seed(1)
    for row in range(8):
        n = int((tokens[row] != 0).sum())
        perm = torch.randperm(n, generator=generator)
        permuted = tokens[row].clone()
        permuted[:n] = tokens[row, perm]
        got = encoder_outputs(encoder, permuted[None])[0]
        torch.testing.assert_close(got[:n], out[row, perm], rtol=0, atol=1e-10)


def test_positional_encodings_break_the_equivariance() -> None:
    torch.manual_seed(0)
    tokens = torch.tensor([[3, 9, 9, 1, 4, 2, 7, 5]])
    perm = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])
    for options in (dict(pos_encoding="sinusoidal"), dict(pos_encoding="none", score="t5_bias")):
        encoder = Encoder(17, 32, 2, 1, **options).double().eval()
        out = encoder_outputs(encoder, tokens)[0]
        got = encoder_outputs(encoder, tokens[:, perm])[0]
        assert (got - out[perm]).abs().max() > 1e-3, options


def test_symmetric_alibi_is_reflection_equivariant_but_not_permutation_equivariant() -> None:
    """The premise of the ALiBi argument: reversing the content reverses the outputs (so x_{i-1} and x_{i+1} look
    alike to it), while other permutations do not commute with it."""
    torch.manual_seed(0)
    encoder = Encoder(17, 32, 2, 2, pad_id=0, pos_encoding="none", score="alibi").double().eval()
    tokens = torch.tensor([[3, 9, 9, 1, 4, 2, 0, 0]])
    out = encoder_outputs(encoder, tokens)[0]
    mirrored = torch.tensor([[2, 4, 1, 9, 9, 3, 0, 0]])
    back = torch.tensor([5, 4, 3, 2, 1, 0])
    torch.testing.assert_close(encoder_outputs(encoder, mirrored)[0, :6], out[back], rtol=0, atol=1e-10)
    swapped = torch.tensor([[9, 3, 9, 1, 4, 2, 0, 0]])
    perm = torch.tensor([1, 0, 2, 3, 4, 5])
    assert (encoder_outputs(encoder, swapped)[0, :6] - out[perm]).abs().max() > 1e-3


# ---------------------------------------------------------------- through the CLI (one subprocess for all three)


@pytest.mark.slow
def test_train_py_runs_each_task_with_test_lengths(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # "++": a multirun first composes the config without the sweep (task=digits), which has no seq_len
    args = [
        "-m",
        f"task={','.join(NAMES)}",
        "debug=fast",
        "logger=none",
        "threads=1",
        "diagnostics.enabled=false",
        "results_table=false",
        "++task.datamodule.seq_len=8",
        "++task.datamodule.test_lengths=[8,16]",
        f"hydra.sweep.dir='{sweep}'",
    ]
    run_train(*args, wandb="disabled", full_error=True, returncode=0)
    summaries = [read_summary(p.parent) for p in sorted(sweep.glob("*/summary.json"))]
    assert sorted(s["task"] for s in summaries) == sorted(NAMES)
    for summary in summaries:
        assert summary["status"] == "ok", summary
        for key in ("test/acc", "test/acc@8", "test/acc@16"):
            assert 0.0 <= summary["metrics"][key] <= 1.0, (summary["task"], key)
