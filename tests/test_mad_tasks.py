"""Tests of MAD's synthetic tasks (attnlab.tasks.mad): fuzzy_recall, noisy_recall, selective_copy, compression and
memorization. Every label is re-derived here by plain loops from the tokens alone, and from the tokens *up to its
position* only (so a causal model can reach it); the layouts, seeding and splits, the memorisation map (shared by the
splits and the seeds), the chance accuracies, the one-line size errors, the task configs, and one tiny training run.
(The generic task tests of tests/test_tasks.py and tests/test_configs.py take these tasks too.)"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helpers
import numpy as np
import pytest
import torch
from helpers import compose_cfg, read_summary
from hydra.utils import instantiate

from attnlab.tasks import (
    IGNORE_INDEX,
    Compression,
    FuzzyRecall,
    Memorization,
    NoisyRecall,
    SelectiveCopy,
    SequenceTask,
    build_task,
    task_class,
)
from attnlab.tasks.base import DATA_KEYS
from attnlab.training.config import validate_config

MAD = ("fuzzy_recall", "noisy_recall", "selective_copy", "compression", "memorization")
SPLITS = ("train", "val", "test")
SIZES: dict[str, Any] = dict(num_train=96, num_val=48, num_test=48, batch_size=16)


small = functools.partial(helpers.small, sizes=SIZES)  # a MAD task of the test's sizes, set up


def rows(task: SequenceTask, split: str) -> list[tuple[list[int], list[int]]]:
    tokens, labels = task.tensors(split)
    return list(zip(tokens.tolist(), labels.tolist(), strict=True))


# ---------------------------------------------------------------- the label of a position, from its prefix alone
# Each reader takes the tokens up to and including one position and returns the label there (-100: none).


def fuzzy_label(prefix: list[int], vocab_keys: int, vocab_values: int) -> int:
    """Keys 1..vocab_keys, values up to vocab_keys + vocab_values, then BLANK; a BLANK is the j-th slot of the answer
    to the key run just before the slots, and the answer is the value run after that key's run in the context."""
    blank = vocab_keys + vocab_values + 1
    if prefix[-1] != blank:
        return IGNORE_INDEX
    end = len(prefix) - 1
    while prefix[end] == blank:
        end -= 1
    slot = len(prefix) - 1 - end  # 1 for the first BLANK
    start = end
    while start > 0 and 1 <= prefix[start - 1] <= vocab_keys:
        start -= 1
    query = prefix[start : end + 1]
    p = 0
    while p < start:  # runs of the context before the query: a key run, then its value run
        q = p
        while q < start and 1 <= prefix[q] <= vocab_keys:
            q += 1
        r = q
        while r < start and vocab_keys < prefix[r] < blank:
            r += 1
        if prefix[p:q] == query and r > q:
            return prefix[q + slot - 1] - vocab_keys - 1
        p = max(r, p + 1)
    raise AssertionError(f"query {query} is not a key of the context {prefix}")


def noisy_label(prefix: list[int], vocab_keys: int, vocab_values: int) -> int:
    """A key that appeared earlier followed by a value is a query: its label is that value."""
    token = prefix[-1]
    if not 1 <= token <= vocab_keys:
        return IGNORE_INDEX
    for p in range(len(prefix) - 2):
        if prefix[p] == token and vocab_keys < prefix[p + 1] <= vocab_keys + vocab_values:
            return prefix[p + 1] - vocab_keys - 1
    return IGNORE_INDEX  # a key of the context


def selective_copy_label(prefix: list[int], vocab: int) -> int:
    """The j-th COPY marker (vocab + 2) is labelled with the j-th content token (1..vocab) of the prefix."""
    if prefix[-1] != vocab + 2:
        return IGNORE_INDEX
    content = [t for t in prefix if 1 <= t <= vocab]
    j = prefix.count(vocab + 2)
    return content[j - 1] - 1


def compression_label(prefix: list[int], vocab: int) -> int:
    """The j-th BLANK (vocab + 2) after COMPRESS (vocab + 1) is labelled with the j-th token before COMPRESS."""
    if prefix[-1] != vocab + 2:
        return IGNORE_INDEX
    marker = prefix.index(vocab + 1)
    j = len(prefix) - 1 - marker
    return prefix[j - 1] - 1


CASES: dict[str, tuple[dict[str, Any], Callable[[list[int]], int]]] = {
    "fuzzy_recall": (
        dict(num_pairs=5, num_queries=3, key_len=2, value_len=3, vocab_keys=3, vocab_values=5, seq_len=50),
        lambda prefix: fuzzy_label(prefix, 3, 5),
    ),
    "noisy_recall": (
        dict(num_pairs=5, num_queries=4, vocab_keys=7, vocab_values=6, vocab_noise=3, frac_noise=0.5),
        lambda prefix: noisy_label(prefix, 7, 6),
    ),
    "selective_copy": (dict(num_tokens=5, vocab=6, seq_len=19), lambda prefix: selective_copy_label(prefix, 6)),
    "compression": (dict(num_tokens=7, vocab=5), lambda prefix: compression_label(prefix, 5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_label_is_re_derived_from_the_tokens_up_to_its_position(name: str) -> None:
    kwargs, label_at = CASES[name]
    task = small(name, **kwargs, seed=7)
    for split in ("train", "val"):
        for row, labels in rows(task, split):
            derived = [label_at(row[: i + 1]) if row[i] != 0 else IGNORE_INDEX for i in range(len(row))]
            assert labels == derived, (split, row)
            assert any(label != IGNORE_INDEX for label in labels)


# ---------------------------------------------------------------- the layouts


def runs_of(row: list[int], kind: Callable[[int], str]) -> list[tuple[str, list[int]]]:
    """Maximal runs of tokens of one kind: [(kind, tokens), ...]."""
    out: list[tuple[str, list[int]]] = []
    for token in row:
        if out and out[-1][0] == kind(token):
            out[-1][1].append(token)
        else:
            out.append((kind(token), [token]))
    return out


def test_fuzzy_recall_layout() -> None:
    n, m, kl, vl, vk, vv = 5, 3, 2, 3, 3, 5
    task = small("fuzzy_recall", **CASES["fuzzy_recall"][0])
    assert (task.vocab_size, task.num_classes, task.seq_len, task.max_len) == (vk + vv + 2, vv, 50, 50)

    def kind(t: int) -> str:
        return "pad" if t == 0 else "key" if t <= vk else "value" if t <= vk + vv else "blank"

    suffix_keys = 0
    for split in SPLITS:
        for row, labels in rows(task, split):
            runs = runs_of(row, kind)
            if runs[-1][0] == "pad":
                runs.pop()
            assert [k for k, _ in runs] == ["key", "value"] * n + ["key", "blank"] * m  # PAD only at the end
            context = {tuple(runs[2 * i][1]): runs[2 * i + 1][1] for i in range(n)}
            assert len(context) == n, "keys repeat in the context"
            assert all(1 <= len(k) <= kl for k in context) and all(1 <= len(v) <= vl for v in context.values())
            queries = [tuple(runs[2 * (n + i)][1]) for i in range(m)]
            assert len(set(queries)) == m and set(queries) <= set(context)
            for i, query in enumerate(queries):
                assert len(runs[2 * (n + i) + 1][1]) == len(context[query])  # one BLANK per value token
            suffix_keys += any(len(a) < len(b) and b[-len(a) :] == a for a in context for b in context)
            assert sum(label != IGNORE_INDEX for label in labels) == sum(len(context[q]) for q in queries)
    assert suffix_keys > 0, "no sequence holds a key that ends another key (the fuzzy case)"


def test_noisy_recall_layout() -> None:
    n, m, vk, vv, vn = 5, 4, 7, 6, 3
    task = small("noisy_recall", **CASES["noisy_recall"][0])
    num_noise = round(0.5 * 2 * n / (1 - 0.5))  # 10: half the context is noise
    assert task.num_noise == num_noise and task.seq_len == 2 * n + num_noise + m
    assert task.vocab_size == vk + vv + vn + 1 and task.num_classes == vv
    where = Counter()
    for split in SPLITS:
        for row, labels in rows(task, split):
            context, queries = row[:-m], row[-m:]
            noise = [i for i, t in enumerate(context) if t > vk + vv]
            assert len(noise) == num_noise and all(t <= vk + vv + vn for t in row)
            pairs = [(context[i], context[i + 1]) for i in range(len(context) - 1) if context[i] <= vk]
            assert len(pairs) == n and all(vk < v <= vk + vv for _, v in pairs)  # a key is always followed by its value
            assert len({k for k, _ in pairs}) == n and len({v for _, v in pairs}) == n
            assert len(set(queries)) == m and set(queries) <= {k for k, _ in pairs}
            assert all(label == IGNORE_INDEX for label in labels[:-m])
            where["before"] += context[0] > vk + vv
            where["after"] += context[-1] > vk + vv
            where["between"] += any(context[i] > vk + vv and 1 <= context[i + 1] <= vk for i in range(1, len(context)))
    assert min(where.values()) > 0, where  # noise lies before, between and after the pairs


def test_selective_copy_layout() -> None:
    task = small("selective_copy", **CASES["selective_copy"][0])
    k, vocab, length = 5, 6, 19
    assert (task.vocab_size, task.num_classes, task.seq_len) == (vocab + 3, vocab, length)
    places = set()
    for row, labels in rows(task, "train"):
        region, slots = row[: length - k], row[length - k :]
        assert slots == [vocab + 2] * k
        content = [i for i, t in enumerate(region) if t <= vocab]
        assert len(content) == k and region.count(vocab + 1) == length - 2 * k
        assert all(label == IGNORE_INDEX for label in labels[: length - k])
        places.add(tuple(content))
    assert len(places) > 20  # the content's places vary


def test_compression_layout() -> None:
    task = small("compression", **CASES["compression"][0])
    n, vocab = 7, 5
    assert (task.vocab_size, task.num_classes, task.seq_len) == (vocab + 3, vocab, 2 * n + 1)
    for row, labels in rows(task, "val"):
        assert all(1 <= t <= vocab for t in row[:n]) and row[n] == vocab + 1 and row[n + 1 :] == [vocab + 2] * n
        assert labels[: n + 1] == [IGNORE_INDEX] * (n + 1) and labels[n + 1 :] == [t - 1 for t in row[:n]]


# ---------------------------------------------------------------- memorization: one map, in the weights


def test_memorization_labels_follow_one_balanced_map_shared_by_the_splits_and_the_seeds() -> None:
    keys, values = 20, 6
    task = small("memorization", vocab_keys=keys, vocab_values=values, seq_len=12, seed=3)
    seen: dict[int, int] = {}
    for split in SPLITS:
        for row, labels in rows(task, split):
            for token, label in zip(row, labels, strict=True):
                assert 1 <= token <= keys
                assert seen.setdefault(token, label) == label, f"key {token} has two values"
    assert sorted(seen) == list(range(1, keys + 1))
    counts = Counter(seen.values())
    assert sorted(counts) == list(range(values)) and max(counts.values()) - min(counts.values()) <= 1
    # the documented construction: a permutation of 0, 1, ..., values-1, 0, 1, ... from SeedSequence([map_seed])
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([0])))
    assert [seen[k] for k in range(1, keys + 1)] == rng.permutation(np.arange(keys) % values).tolist()
    assert task.mapping.tolist() == [seen[k] for k in range(1, keys + 1)]
    other_seed = small("memorization", vocab_keys=keys, vocab_values=values, seq_len=12, seed=4)
    assert np.array_equal(other_seed.mapping, task.mapping)
    assert not torch.equal(other_seed.tensors("train")[0], task.tensors("train")[0])
    other_map = small("memorization", vocab_keys=keys, vocab_values=values, seq_len=12, seed=3, map_seed=1)
    assert not np.array_equal(other_map.mapping, task.mapping)
    assert torch.equal(other_map.tensors("train")[0], task.tensors("train")[0])  # the same keys, other values


# ---------------------------------------------------------------- seeding and splits


@pytest.mark.parametrize("name", MAD)
def test_seeded_and_the_three_splits_differ(name: str) -> None:
    a, b, c = small(name, seed=5), small(name, seed=5), small(name, seed=6)
    for split in SPLITS:
        for x, y in zip(a.tensors(split), b.tensors(split), strict=True):
            assert torch.equal(x, y)
        assert not torch.equal(a.tensors(split)[0], c.tensors(split)[0])
    tokens = [a.tensors(split)[0][:48] for split in SPLITS]
    for x, y in itertools.combinations(tokens, 2):
        assert not torch.equal(x, y)


# ---------------------------------------------------------------- chance accuracies


def bag_of_tokens(vocab: int, k: int) -> float:
    """E[count of the most frequent token] / k over every sequence of k tokens from vocab, enumerated."""
    total = sum(max(Counter(seq).values()) for seq in itertools.product(range(vocab), repeat=k))
    return total / vocab**k / k


def test_chance_accuracies() -> None:
    assert NoisyRecall(num_pairs=5, vocab_keys=5, vocab_values=5).chance_accuracy == pytest.approx(1 / 5)
    assert Memorization(vocab_keys=10, vocab_values=4).chance_accuracy == pytest.approx(3 / 10)
    assert Memorization().chance_accuracy == pytest.approx(1 / 16)
    for vocab, k in [(2, 2), (3, 4), (5, 3)]:
        exact = bag_of_tokens(vocab, k)
        assert SelectiveCopy(num_tokens=k, vocab=vocab).chance_accuracy == pytest.approx(exact, abs=0.01)
        assert Compression(num_tokens=k, vocab=vocab).chance_accuracy == pytest.approx(exact, abs=0.01)
    # single-token distinct-enough values: close to MQAR's 1 / num_pairs
    assert FuzzyRecall(num_pairs=4, value_len=1, vocab_values=1000).chance_accuracy == pytest.approx(1 / 4, abs=0.01)


def test_fuzzy_recall_chance_is_the_bag_of_values_guess() -> None:
    """At the j-th slot, guess the most frequent j-th token among the context's values of at least j tokens: its
    expected accuracy, averaged here over the labels of a fresh data set by plain loops, is chance_accuracy."""
    kwargs = dict(num_pairs=4, key_len=2, value_len=2, vocab_keys=4, vocab_values=5)
    task = small("fuzzy_recall", **kwargs, num_train=2000, num_val=10, num_test=10, seed=11)
    correct = labelled = 0.0
    for row, labels in rows(task, "train"):
        context: list[list[int]] = []  # the value runs of the context
        for kind, run in runs_of(row, lambda t: "value" if 4 < t <= 9 else "other"):
            if kind == "value":
                context.append(run)
        slot = 0
        for token, label in zip(row, labels, strict=True):
            slot = slot + 1 if token == 10 else 0
            if label != IGNORE_INDEX:
                candidates = [v[slot - 1] for v in context if len(v) >= slot]
                correct += max(Counter(candidates).values()) / len(candidates)
                labelled += 1
    assert task.chance_accuracy == pytest.approx(correct / labelled, abs=0.02)
    assert task.chance_accuracy > 1 / 4  # multi-token values and a small vocabulary: above 1 / num_pairs


# ---------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (FuzzyRecall, dict(num_pairs=0), "num_pairs must be an integer >= 1, got 0"),
        (FuzzyRecall, dict(key_len=0), "key_len must be an integer >= 1, got 0"),
        (FuzzyRecall, dict(value_len=0), "value_len must be an integer >= 1, got 0"),
        (FuzzyRecall, dict(vocab_keys=0), "vocab_keys must be an integer >= 1, got 0"),
        (FuzzyRecall, dict(vocab_values=1), "vocab_values must be an integer >= 2, got 1"),
        (
            FuzzyRecall,
            dict(num_pairs=7, key_len=2, vocab_keys=2),
            "num_pairs must be an integer in [1, 6] (the distinct keys of 1..key_len=2 tokens from vocab_keys=2), "
            "got 7",
        ),
        (FuzzyRecall, dict(num_pairs=3, num_queries=4), "num_queries must be an integer in [1, 3], got 4"),
        (
            FuzzyRecall,
            dict(num_pairs=2, num_queries=1, seq_len=10),
            "seq_len must be >= (num_pairs + num_queries) * (key_len + value_len) = 12, got 10",
        ),
        (NoisyRecall, dict(num_pairs=0), "num_pairs must be an integer >= 1, got 0"),
        (NoisyRecall, dict(num_pairs=4, num_queries=5), "num_queries must be an integer in [1, 4], got 5"),
        (NoisyRecall, dict(num_pairs=8, vocab_keys=6), "vocab_keys must be an integer >= 8, got 6"),
        (NoisyRecall, dict(num_pairs=8, vocab_values=7), "vocab_values must be an integer >= 8, got 7"),
        (NoisyRecall, dict(vocab_noise=0), "vocab_noise must be an integer >= 1, got 0"),
        (NoisyRecall, dict(frac_noise=1.0), "frac_noise must be a finite number in [0, 1), got 1.0"),
        (NoisyRecall, dict(frac_noise=-0.1), "frac_noise must be a finite number in [0, 1), got -0.1"),
        (SelectiveCopy, dict(num_tokens=0), "num_tokens must be an integer >= 1, got 0"),
        (SelectiveCopy, dict(vocab=1), "vocab must be an integer >= 2, got 1"),
        (SelectiveCopy, dict(num_tokens=8, seq_len=15), "seq_len must be >= 2*num_tokens = 16, got 15"),
        (Compression, dict(num_tokens=0), "num_tokens must be an integer >= 1, got 0"),
        (Compression, dict(vocab=1), "vocab must be an integer >= 2, got 1"),
        (Memorization, dict(vocab_values=1), "vocab_values must be an integer >= 2, got 1"),
        (Memorization, dict(vocab_keys=8, vocab_values=16), "vocab_keys must be an integer >= 16, got 8"),
        (Memorization, dict(seq_len=0), "seq_len must be an integer >= 1, got 0"),
        (Memorization, dict(map_seed=-1), "map_seed must be an integer >= 0, got -1"),
        (
            SelectiveCopy,
            dict(test_lengths=[64]),
            "task selective_copy does not support test_lengths (it has no length-generalisation split)",
        ),
    ],
)
def test_impossible_sizes_raise_one_line_value_errors(cls: type, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    assert str(info.value) == message


def test_an_unknown_parameter_is_named_with_what_the_task_takes() -> None:
    with pytest.raises(ValueError) as info:
        build_task("noisy_recall", noise=0.2)
    assert str(info.value).startswith(
        "task 'noisy_recall' does not take parameter 'noise'; allowed: num_pairs, num_queries, vocab_keys, "
        "vocab_values, vocab_noise, frac_noise, batch_size, "
    )


# ---------------------------------------------------------------- configs and training


@pytest.mark.parametrize("name", MAD)
def test_each_task_config_composes_selects_causal_and_gives_a_batch(hydra_ctx: None, name: str) -> None:
    cfg = compose_cfg(f"task={name}", "debug=fast")
    assert cfg.mask.name == "causal" and cfg.task.name == name
    assert compose_cfg(f"task={name}", "mask=none").mask.name == "none"  # the user's choice wins
    task = validate_config(cfg)
    cls = task_class(name)
    assert type(task) is cls and type(instantiate(cfg.task.datamodule)) is cls
    defaults = cls()  # the config states the class's own defaults (test_tasks.py checks the shared data options)
    for key, value in cfg.task.datamodule.items():
        if key != "_target_" and key not in DATA_KEYS and value is not None:
            assert getattr(defaults, key) == value, f"conf/task/{name}.yaml: {key}"
    assert (task.seq_len, task.vocab_size, task.chance_accuracy) == (
        defaults.seq_len,
        defaults.vocab_size,
        defaults.chance_accuracy,
    )
    assert 32 <= defaults.seq_len <= 64 and 0 < defaults.chance_accuracy < 0.5
    tokens, labels = next(iter(task.train_dataloader()))
    assert tokens.shape == labels.shape == (cfg.batch_size, task.seq_len)
    assert (labels != IGNORE_INDEX).any(dim=1).all()


@pytest.mark.usefixtures("restore_process_state")
def test_a_tiny_run_trains_selective_copy(hydra_ctx: None, tmp_path: Path) -> None:
    from attnlab.training import run

    overrides = ["task=selective_copy", "debug=fast", "logger=none", "results_table=false", "d_model=16"]
    run(compose_cfg(*overrides, "num_heads=2", "diagnostics.enabled=false"), tmp_path)
    summary = read_summary(tmp_path)
    assert summary["status"] == "ok", summary["reason"]
    assert (summary["task"], summary["mask"], summary["steps"]) == ("selective_copy", "causal", 5)
    assert summary["chance_accuracy"] == pytest.approx(SelectiveCopy().chance_accuracy)
    assert math.isfinite(summary["metrics"]["test/loss"]) and 0 <= summary["metrics"]["test/acc"] <= 1
