"""Tests of attnlab.tasks: determinism, label correctness (checked by independent code), shapes, errors; the task
registry (a user's task through ``imports``) and the data options every task shares."""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helpers
import numpy as np
import pytest
import torch
from hydra import compose
from omegaconf import OmegaConf
from sklearn.datasets import load_digits

import attnlab
from attnlab.registry import UnknownNameError
from attnlab.tasks import (
    _TASKS,
    IGNORE_INDEX,
    AssociativeRecall,
    DataOptions,
    Digits,
    ListOps,
    SequenceTask,
    build_task,
    list_tasks,
    task_class,
)
from attnlab.tasks.base import DATA_KEYS, task_options
from attnlab.tasks.listops import detokenize, evaluate, to_tokens
from attnlab.training.config import CONF_DIR, ConfigError, check_group_choices, validate_config

REPO = Path(__file__).resolve().parents[1]

SPLITS = ("train", "val", "test")
BUILTIN = list_tasks()  # every registered task (the built-ins: the tests register theirs only for a while)

# small, fast configurations of every task: these sizes, except where a task needs others
SMALL_SIZES: dict[str, Any] = dict(num_train=300, num_val=100, num_test=100, batch_size=32)
SMALL: dict[str, dict[str, Any]] = {
    "digits": dict(num_val=100, num_test=100, batch_size=32),  # (num_train: all the rest)
    "text": dict(SMALL_SIZES, seq_len=32),
}


def small_kwargs(name: str) -> dict[str, Any]:
    return SMALL.get(name, SMALL_SIZES)


small = functools.partial(helpers.small, sizes=small_kwargs)  # a task of its test sizes, set up


def all_tensors(task: SequenceTask) -> list[torch.Tensor]:
    return [t for split in SPLITS for t in task.tensors(split)]


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", BUILTIN)
def test_same_seed_gives_identical_splits(name: str) -> None:
    a, b = small(name, seed=3), small(name, seed=3)
    for x, y in zip(all_tensors(a), all_tensors(b), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", BUILTIN)
def test_different_seeds_differ(name: str) -> None:
    a, b = small(name, seed=0), small(name, seed=1)
    for split in SPLITS:
        assert not torch.equal(a.tensors(split)[0], b.tensors(split)[0]), split


@pytest.mark.parametrize("name", BUILTIN)
def test_num_train_leaves_val_and_test_unchanged(name: str) -> None:
    a, b = small(name, num_train=200), small(name, num_train=150)
    assert len(a.tensors("train")[0]) == 200 and len(b.tensors("train")[0]) == 150
    for split in ("val", "test"):
        for x, y in zip(a.tensors(split), b.tensors(split), strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("name", BUILTIN)
def test_train_loader_order_is_seeded(name: str) -> None:
    def first_batches(seed: int) -> list[torch.Tensor]:
        loader = small(name, seed=seed).train_dataloader()
        return [tokens for tokens, _ in list(loader)[:3]]

    for x, y in zip(first_batches(5), first_batches(5), strict=True):
        assert torch.equal(x, y)


# ---------------------------------------------------------------- shapes, dtypes, padding


@pytest.mark.parametrize("name", BUILTIN)
def test_shapes_dtypes_and_padding(name: str) -> None:
    task = small(name)
    assert task.pad_id == 0
    assert task.max_len >= task.seq_len
    for split in SPLITS:
        tokens, labels = task.tensors(split)
        n = task.split_size(split)
        length = task.split_len(split)
        assert length <= task.max_len
        if split in ("train", "val"):
            assert length == task.seq_len
        assert tokens.dtype == torch.long and labels.dtype == torch.long
        assert tokens.shape == (n, length)
        assert labels.shape == ((n, length) if task.per_token else (n,))
        assert tokens.min() >= 0 and tokens.max() < task.vocab_size
        content = tokens != task.pad_id
        # right padding: once a PAD appears, the rest of the row is PAD; every row has content
        assert torch.equal(content, content.cummin(dim=1).values)
        assert content[:, 0].all()
        if task.per_token:
            target = labels != IGNORE_INDEX
            assert (labels[target] >= 0).all() and (labels[target] < task.num_classes).all()
            assert not (target & ~content).any(), "a padded position has a target"
            assert target.any(dim=1).all(), "every sequence has at least one target"
        else:
            assert labels.min() >= 0 and labels.max() < task.num_classes


@pytest.mark.parametrize("name", BUILTIN)
def test_dataloaders_yield_token_label_batches(name: str) -> None:
    task = small(name)
    for split, loader in [
        ("train", task.train_dataloader()),
        ("val", task.val_dataloader()),
        ("test", task.test_dataloader()),
    ]:
        tokens, labels = next(iter(loader))
        assert tokens.shape == (32, task.split_len(split))
        assert labels.shape[0] == 32 and labels.dtype == torch.long
    tokens, labels = next(iter(task.val_dataloader()))
    assert torch.equal(tokens, task.tensors("val")[0][:32])


# ---------------------------------------------------------------- probe batch, describe, registry


@pytest.mark.parametrize("name", BUILTIN)
def test_probe_batch_is_first_validation_examples_and_fixed(name: str) -> None:
    task = small(name)
    tokens, labels = task.probe_batch(5)
    val_tokens, val_labels = task.tensors("val")
    assert torch.equal(tokens, val_tokens[:5]) and torch.equal(labels, val_labels[:5])
    tokens[:] = 0  # a copy: editing it leaves the data alone
    assert torch.equal(task.probe_batch(5)[0], val_tokens[:5])
    other = small(name, num_train=64, batch_size=16)
    assert torch.equal(other.probe_batch(5)[0], val_tokens[:5])
    assert task.probe_batch()[0].shape[0] == 8


@pytest.mark.parametrize("name", BUILTIN)
def test_describe_is_one_line(name: str) -> None:
    text = build_task(name, **small_kwargs(name)).describe()
    assert name in text and "\n" not in text


# ---------------------------------------------------------------- the registry and the shared data options


USER_TASK = """
import numpy as np

from attnlab import register_task
from attnlab.tasks import DataOptions, SequenceTask


@register_task("{name}")
class Parity(SequenceTask):
    per_token = False
    data_defaults = DataOptions(num_train=2000)

    def __init__(self, length: int = 16, **data):
        super().__init__(**data)
        self.vocab_size, self.num_classes = 3, 2
        self.seq_len = self.max_len = length

    def generate(self, split, num, rng):
        bits = rng.integers(0, 2, size=(num, self.seq_len))
        return bits + 1, bits.sum(axis=1) % 2
"""


@pytest.fixture
def user_task() -> Iterator[str]:
    """A task registered from a module of the test's own, as a user's: its name; unregistered afterwards."""
    name = f"test_parity_{uuid.uuid4().hex[:8]}"
    namespace: dict[str, Any] = {}
    exec(compile(USER_TASK.format(name=name), f"<{name}>", "exec"), namespace)
    yield name
    _TASKS._entries.pop(name, None)


def test_every_builtin_task_has_its_config_and_every_config_a_task() -> None:
    builtin = [n for n in list_tasks() if task_class(n).__module__.startswith("attnlab.tasks.")]
    assert builtin == BUILTIN
    configs = {path.stem: OmegaConf.load(path) for path in (CONF_DIR / "task").glob("*.yaml")}
    assert set(configs) == {*builtin, "custom"}
    for name in builtin:
        cls, datamodule = task_class(name), configs[name].datamodule
        assert configs[name].name == name == cls.name
        assert datamodule._target_.rpartition(".")[2] == cls.__name__
        # the config states the class's own defaults of the shared options (batch_size and seed come from the root)
        for key in DATA_KEYS:
            if key in datamodule and key not in ("batch_size", "seed"):
                assert datamodule[key] == getattr(cls.data_defaults, key), f"conf/task/{name}.yaml: {key}"
    custom = configs["custom"]
    assert OmegaConf.is_missing(custom, "name") and "_target_" not in custom.datamodule


def test_a_registered_task_is_listed_and_built_by_name(user_task: str) -> None:
    assert user_task in list_tasks() and user_task in attnlab.list_tasks()
    task = attnlab.build_task(user_task, length=6, num_train=40, batch_size=8)
    assert task.name == user_task == type(task).name and task.seq_len == 6
    tokens, labels = task.tensors("train")
    assert tokens.shape == (40, 6) and torch.equal(labels, (tokens - 1).sum(dim=1) % 2)
    with pytest.raises(ValueError, match=f"task '{user_task}' is already registered"):
        attnlab.register_task(user_task)(type("Other", (SequenceTask,), {}))


def test_registering_refuses_a_builtin_name_and_a_class_that_is_no_task() -> None:
    with pytest.raises(ValueError, match="task 'digits' is already registered"):
        attnlab.register_task("digits")(type("MyDigits", (SequenceTask,), {"__module__": "my_pkg.tasks"}))
    with pytest.raises(TypeError, match=r"needs a subclass of attnlab\.tasks\.SequenceTask"):
        attnlab.register_task(f"test_{uuid.uuid4().hex[:8]}")(dict)
    assert "MyDigits" not in {task_class(n).__name__ for n in list_tasks()}


def test_an_unknown_task_name_is_one_line_with_the_closest_name() -> None:
    with pytest.raises(UnknownNameError) as info:
        build_task("shfit")
    assert str(info.value).startswith("unknown task 'shfit'; did you mean 'shift'? Registered: ")
    assert "\n" not in str(info.value)


def test_unknown_and_missing_task_names_in_a_config(hydra_ctx: None) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(compose("config", overrides=["task=custom", "task.name=shfit"]))
    assert re.fullmatch(
        r"unknown task 'shfit'; did you mean 'shift'\? Registered: .*\. A task of your own: task=custom "
        r"task.name=<name> 'imports=\[module\]'",
        str(info.value),
    )
    with pytest.raises(ConfigError, match=r"^task.name is not set \(\?\?\?\): task=custom needs task.name=<your"):
        validate_config(compose("config", overrides=["task=custom"]))
    with pytest.raises(ConfigError, match=r"^unknown task 'palindrome'\. .*Your own task: task=custom task.name=palin"):
        check_group_choices(["task=palindrome"])


def test_the_shared_data_options_and_each_task_s_defaults() -> None:
    assert DataOptions() == DataOptions(64, 1000, 200, 200, 0, 0, False, None)
    assert DATA_KEYS == (
        "batch_size",
        "num_train",
        "num_val",
        "num_test",
        "seed",
        "num_workers",
        "resample",
        "test_lengths",
    )
    for name in BUILTIN:
        cls = task_class(name)
        assert "batch_size" not in inspect.signature(cls.__init__).parameters, f"{name} re-declares batch_size"
        assert task_options(cls)[-len(DATA_KEYS) :] == list(DATA_KEYS)
    recall, text, digits = AssociativeRecall(), build_task("text"), Digits(num_val=100)
    assert (recall.batch_size, recall.num_train, recall.num_val, recall.num_test) == (64, 10_000, 1_000, 1_000)
    assert (text.batch_size, text.num_train, text.resample, text.test_lengths) == (16, 3000, True, ())
    assert digits.num_train == 1797 - 100 - 270  # None: all that is left
    assert digits.data_options == DataOptions(64, 1427, 100, 270, 0, 0, False, ())
    shift = build_task("shift", offset=2, num_train=50, seed=3, test_lengths=[8, 16])
    assert shift.data_options == DataOptions(64, 50, 1_000, 1_000, 3, 0, False, (8, 16))
    assert (shift.num_train, shift.seed, shift.test_lengths) == (50, 3, (8, 16))
    with pytest.raises(AttributeError, match="num_train is read-only"):
        shift.num_train = 10


def test_a_parameter_no_task_takes_is_named_with_what_it_takes() -> None:
    with pytest.raises(ValueError) as info:
        build_task("shift", offest=2)
    assert str(info.value) == (
        "task 'shift' does not take parameter 'offest'; allowed: offset, vocab, seq_len, min_length, batch_size, "
        "num_train, num_val, num_test, seed, num_workers, resample, test_lengths"
    )


def test_the_command_line_keeps_flat_keys_and_errors_name_them(hydra_ctx: None) -> None:
    cfg = compose("config", overrides=["task=shift", "task.datamodule.num_train=500", "task.datamodule.offset=2"])
    task = validate_config(cfg)
    assert (task.num_train, task.offset, task.batch_size, task.seed) == (500, 2, cfg.batch_size, cfg.seed)
    for override, message in [
        ("task.datamodule.num_train=0", "task.datamodule.num_train must be an integer >= 1, got 0"),
        ("task.datamodule.seed=-1", "task.datamodule.seed must be an integer >= 0, got -1"),
        ("+task.datamodule.num_workers=-1", "task.datamodule.num_workers must be an integer >= 0, got -1"),
        ("task.datamodule.test_lengths=[8,8]", "task.datamodule.test_lengths has a length twice: [8, 8]"),
    ]:
        with pytest.raises(ConfigError) as info:
            validate_config(compose("config", overrides=["task=shift", override]))
        assert str(info.value) == message


def test_an_old_run_folder_s_flat_config_still_validates(hydra_ctx: None) -> None:
    """A config.yaml written before the shared options (every key flat under task.datamodule, with _target_)."""
    cfg = compose("config", overrides=["task=associative_recall"])
    old = OmegaConf.create(
        {
            "_target_": "attnlab.tasks.AssociativeRecall",
            **dict(num_pairs=4, num_queries=None, vocab_keys=8, vocab_values=8, seq_len=None, fused_pairs=False),
            **dict(resample=False, test_lengths=[16], num_train=256, num_val=64, num_test=64, batch_size=16, seed=2),
        }
    )
    cfg.task.datamodule = old
    task = validate_config(cfg)
    assert isinstance(task, AssociativeRecall)
    assert task.data_options == DataOptions(16, 256, 64, 64, 2, 0, False, (16,))


def test_a_user_task_is_built_from_the_config_and_a_target_naming_another_class_is_refused(
    hydra_ctx: None, user_task: str
) -> None:
    base = ["task=custom", f"task.name={user_task}", "+task.datamodule.length=8", "debug=fast"]
    task = validate_config(compose("config", overrides=base))
    assert task.name == user_task and task.seq_len == 8 and (task.num_train, task.num_val) == (64, 32)
    own = validate_config(compose("config", overrides=[*base, "+task.datamodule._target_=my_pkg.tasks.Parity"]))
    assert type(own).__name__ == "Parity"  # (the _target_ is compared by class name, and never imported)
    for target in ("attnlab.tasks.Digits", "subprocess.Popen"):
        with pytest.raises(ConfigError, match=rf"^task.datamodule._target_={target} is not the class of task="):
            validate_config(compose("config", overrides=[*base, f"+task.datamodule._target_={target}"]))
    with pytest.raises(ConfigError, match=r"^task.datamodule: task '.*' does not take parameter 'lenght'"):
        validate_config(compose("config", overrides=[*base[:2], "+task.datamodule.lenght=8"]))


@pytest.mark.slow
def test_a_user_task_trains_through_imports_in_a_sweep_and_resumes(tmp_path: Path) -> None:
    """The README's route: a module that registers a task, ``task=custom task.name=... 'imports=[module]'`` with
    its own argument as ``+task.datamodule...``, in a multirun sweep (-m) of two seeds; then a resume of one job
    with the same imports, past its end."""
    name = f"test_parity_{uuid.uuid4().hex[:8]}"
    module = f"attnlab_test_tasks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(USER_TASK.format(name=name))
    env = {k: v for k, v in os.environ.items() if k not in ("ATTNLAB_UID", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    common = ["debug=fast", "d_model=16", "num_heads=2", "num_layers=1", "logger=none", "threads=1"]

    def train(*args: str) -> None:
        proc = subprocess.run(
            [sys.executable, str(REPO / "train.py"), *args, *common, f"imports=[{module}]"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    sweep = tmp_path / "sweep"
    train("-m", "task=custom", f"task.name={name}", "+task.datamodule.length=8", "seed=0,1", f"hydra.sweep.dir={sweep}")
    jobs = sorted(p for p in sweep.iterdir() if (p / "summary.json").is_file())
    assert len(jobs) == 2
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        assert (summary["status"], summary["task"], summary["steps"]) == ("ok", name, 5)
        saved = OmegaConf.load(job / "config.yaml")
        assert saved.task.name == name and saved.task.datamodule.length == 8 and saved.imports == [module]
    train("resume=true", f"hydra.run.dir='{jobs[0]}'", "max_steps=10")
    summary = json.loads((jobs[0] / "summary.json").read_text())
    assert (summary["status"], summary["task"], summary["steps"]) == ("ok", name, 10)


# ---------------------------------------------------------------- associative recall


def test_associative_recall_labels_by_plain_scan() -> None:
    n, m = 6, 4
    task = small("associative_recall", num_pairs=n, num_queries=m, vocab_keys=10, vocab_values=12)
    keys = range(1, 11)
    values = range(11, 23)
    for split in SPLITS:
        tokens, labels = task.tensors(split)
        for row, row_labels in zip(tokens.tolist(), labels.tolist(), strict=True):
            assert len(row) == 2 * n + m
            memory: dict[int, int] = {}
            for i in range(0, 2 * n, 2):
                key, value = row[i], row[i + 1]
                assert key in keys and value in values
                assert key not in memory, "keys repeat in the context"
                memory[key] = value
                assert row_labels[i] == IGNORE_INDEX and row_labels[i + 1] == IGNORE_INDEX
            assert len(set(memory.values())) == n, "values repeat in the context"
            queries = row[2 * n :]
            assert len(set(queries)) == m
            for token, label in zip(queries, row_labels[2 * n :], strict=True):
                assert token in memory
                assert label == memory[token] - 11


def test_associative_recall_longer_seq_len_spreads_queries_between_fillers() -> None:
    n, m, length = 4, 3, 40
    task = small("associative_recall", num_pairs=n, num_queries=m, seq_len=length)
    assert task.seq_len == task.max_len == length
    tokens, labels = task.tensors("val")
    region_tokens, region_labels = tokens[:, 2 * n :], labels[:, 2 * n :]
    is_query = region_tokens != task.filler_id
    assert (is_query.sum(dim=1) == m).all()
    assert torch.equal(is_query, region_labels != IGNORE_INDEX)
    assert (tokens[:, : 2 * n] != task.filler_id).all()
    # the query positions vary between sequences
    assert len({tuple(row.nonzero().flatten().tolist()) for row in is_query}) > 1
    for row, row_labels in zip(tokens.tolist(), labels.tolist(), strict=True):
        memory = {row[i]: row[i + 1] for i in range(0, 2 * n, 2)}
        for token, label in zip(row[2 * n :], row_labels[2 * n :], strict=True):
            if token != task.filler_id:
                assert label == memory[token] - task.value_offset


def test_associative_recall_attributes() -> None:
    task = AssociativeRecall()
    assert (task.num_pairs, task.num_queries, task.seq_len) == (8, 8, 24)
    assert task.vocab_size == 32 + 32 + 2 and task.num_classes == 32 and task.per_token


# ---------------------------------------------------------------- listops


def reference_value(text: str) -> int:
    """Independent ListOps evaluator over the space-separated text form."""
    words = text.split()

    def parse(pos: int) -> tuple[int, int]:
        word = words[pos]
        if word.isdigit():
            return int(word), pos + 1
        op, pos = word, pos + 1
        args: list[int] = []
        while words[pos] != "]":
            value, pos = parse(pos)
            args.append(value)
        if op == "[MIN":
            result = min(args)
        elif op == "[MAX":
            result = max(args)
        elif op == "[SM":
            result = sum(args) % 10
        elif op == "[MED":
            ordered = sorted(args)
            k = len(ordered)
            result = ordered[k // 2] if k % 2 == 1 else int((ordered[k // 2 - 1] + ordered[k // 2]) / 2)
        else:
            raise AssertionError(f"unknown operator {op}")
        return result, pos + 1

    value, end = parse(0)
    assert end == len(words), f"trailing tokens in {text!r}"
    return value


def test_listops_labels_match_independent_evaluator() -> None:
    task = small("listops", num_val=300, test_min_length=30, test_max_length=96, test_max_depth=4)
    for split in ("val", "test"):
        tokens, labels = task.tensors(split)
        for row, label in zip(tokens, labels.tolist(), strict=True):
            assert reference_value(detokenize(row)) == label


def test_listops_lengths_and_test_split_for_length_generalisation() -> None:
    task = small("listops", min_length=8, max_length=40, test_min_length=41, test_max_length=80, test_max_depth=4)
    assert (task.seq_len, task.max_len) == (40, 80)
    for split, (lo, hi) in [("train", (8, 40)), ("val", (8, 40)), ("test", (41, 80))]:
        tokens, _ = task.tensors(split)
        assert tokens.shape[1] == hi
        lengths = (tokens != 0).sum(dim=1)
        assert lengths.min() >= lo and lengths.max() <= hi
        # brackets balance and every sequence is a bracketed expression
        opens = (tokens >= 11) & (tokens <= 14)
        assert torch.equal(opens.sum(dim=1), (tokens == 15).sum(dim=1))
        assert ((tokens[:, 0] >= 11) & (tokens[:, 0] <= 14)).all()


def test_listops_helpers() -> None:
    tree = ("[MAX", [2, 9, ("[MIN", [4, 7]), 0])
    assert detokenize(to_tokens(tree)) == "[MAX 2 9 [MIN 4 7 ] 0 ]"
    assert detokenize([*to_tokens(tree), 0, 0]) == "[MAX 2 9 [MIN 4 7 ] 0 ]"
    assert evaluate(tree) == 9
    assert evaluate(("[MED", [1, 2])) == 1  # int(np.median([1, 2])) = int(1.5)
    assert evaluate(("[MED", [3, 8, 4, 1])) == 3  # int(3.5)
    assert evaluate(("[MED", [5, 0, 9])) == 5
    assert evaluate(("[SM", [9, 8, 7])) == 4
    assert ListOps.evaluate(tree) == 9
    rng = np.random.default_rng(0)
    for _ in range(200):
        args = rng.integers(0, 10, size=rng.integers(2, 7)).tolist()
        assert evaluate(("[MED", args)) == int(np.median(args))


def test_listops_labels_cover_all_classes() -> None:
    _, labels = small("listops").tensors("train")
    assert set(labels.tolist()) == set(range(10))


# ---------------------------------------------------------------- digits


def test_digits_match_sklearn() -> None:
    data = load_digits()
    pixels = data.data.astype(np.int64)
    task = small("digits")
    index = task.split_indices()
    seen: set[int] = set()
    for split in SPLITS:
        tokens, labels = task.tensors(split)
        idx = index[split]
        assert not seen & set(idx.tolist())
        seen |= set(idx.tolist())
        for row in range(0, len(idx), 37):
            assert tokens[row].tolist() == [p + 1 for p in pixels[idx[row]].tolist()]
            assert labels[row].item() == data.target[idx[row]]
    # every image of the data set is somewhere, with its own label
    lookup: dict[tuple[int, ...], set[int]] = {}
    for image, target in zip(pixels.tolist(), data.target.tolist(), strict=True):
        lookup.setdefault(tuple(image), set()).add(target)
    tokens, labels = task.tensors("val")
    for row, label in zip(tokens.tolist(), labels.tolist(), strict=True):
        assert label in lookup[tuple(p - 1 for p in row)]


def test_digits_default_split_is_stratified() -> None:
    task = Digits()
    assert (task.num_train, task.num_val, task.num_test) == (1257, 270, 270)
    assert (task.vocab_size, task.num_classes, task.seq_len) == (18, 10, 64)
    task.setup()
    for split in ("val", "test"):
        counts = np.bincount(task.tensors(split)[1].numpy(), minlength=10)
        assert counts.min() >= 25 and counts.max() <= 29


def test_digits_permute_is_a_fixed_seeded_permutation() -> None:
    plain, permuted = small("digits"), small("digits", permute=True)
    perm = permuted.permutation
    assert sorted(perm.tolist()) == list(range(64)) and not np.array_equal(perm, np.arange(64))
    assert np.array_equal(perm, small("digits", permute=True).permutation)
    assert not np.array_equal(perm, small("digits", permute=True, seed=1).permutation)
    tokens, labels = plain.tensors("val")
    p_tokens, p_labels = permuted.tensors("val")
    assert torch.equal(p_tokens, tokens[:, torch.from_numpy(perm)]) and torch.equal(p_labels, labels)


# ---------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (AssociativeRecall, dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
        (AssociativeRecall, dict(num_val=0), "num_val must be an integer >= 1, got 0"),
        (AssociativeRecall, dict(seed=-1), "seed must be an integer >= 0, got -1"),
        (AssociativeRecall, dict(num_workers=1.5), "num_workers must be an integer >= 0, got 1.5"),
        (AssociativeRecall, dict(num_pairs=0), "num_pairs must be an integer >= 1, got 0"),
        (AssociativeRecall, dict(num_pairs=4, num_queries=5), "num_queries must be an integer in [1, 4], got 5"),
        (AssociativeRecall, dict(num_pairs=8, vocab_keys=6), "vocab_keys must be an integer >= 8, got 6"),
        (AssociativeRecall, dict(num_pairs=8, vocab_values=7), "vocab_values must be an integer >= 8, got 7"),
        (
            AssociativeRecall,
            dict(num_pairs=4, seq_len=10),
            "seq_len must be >= 2*num_pairs + num_queries = 12, got 10",
        ),
        (ListOps, dict(max_depth=0), "max_depth must be an integer >= 1, got 0"),
        (ListOps, dict(max_args=1), "max_args must be an integer >= 2, got 1"),
        (ListOps, dict(leaf_prob=1.5), "leaf_prob must be a finite number in [0, 1], got 1.5"),
        (ListOps, dict(max_length=3), "max_length must be an integer >= 4, got 3"),
        (ListOps, dict(min_length=70), "min_length must be an integer in [1, 64], got 70"),
        (ListOps, dict(test_max_length=2), "test_max_length must be an integer >= 4, got 2"),
        (ListOps, dict(max_depth=1, max_args=3, min_length=6), "min_length (6) is longer than any tree"),
        (Digits, dict(num_val=5), "num_val must be an integer >= 10, got 5"),
        (Digits, dict(num_train=2000), "num_train must be an integer in [1, 1257], got 2000"),
        (Digits, dict(num_val=900, num_test=900), "num_val + num_test must be <= 1787"),
        (Digits, dict(permute="yes"), "permute must be True or False, got 'yes'"),
    ],
)
def test_bad_arguments_raise_one_line_value_errors(cls: type, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_batch_larger_than_training_set_fails_in_setup() -> None:
    task = ListOps(num_train=300, batch_size=512)
    with pytest.raises(ValueError, match=r"^batch_size \(512\) is larger than the training set \(300\)$"):
        task.setup()


def test_unreachable_lengths_fail_with_a_clear_message() -> None:
    # possible (the longest tree has 106 tokens) but far too rare to reach
    task = ListOps(num_train=10, num_val=10, num_test=10, batch_size=8, min_length=100, max_length=100)
    with pytest.raises(ValueError, match=r"trees had a length in \[100, 100\]"):
        task.setup()


def test_probe_batch_size_is_checked() -> None:
    task = small("associative_recall")
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 100\], got 101"):
        task.probe_batch(101)
    with pytest.raises(ValueError, match="split must be one of train, val, test, got 'dev'"):
        task.tensors("dev")


def test_fused_pair_recall_labels_match_a_plain_scan() -> None:
    """With fused_pairs, context token = pair_offset + key * vocab_values + value; every query's label is the value
    of the one context pair holding its key, recomputed here by a plain loop."""
    task = AssociativeRecall(
        num_pairs=5,
        vocab_keys=7,
        vocab_values=6,
        fused_pairs=True,
        num_train=50,
        num_val=20,
        batch_size=10,
        num_test=20,
        seed=3,
    )
    task.setup("fit")
    tokens, labels = task.tensors("train")
    assert tokens.shape == (50, 5 + 5) and task.vocab_size == 7 + 6 + 2 + 7 * 6
    for row_tokens, row_labels in zip(tokens.tolist(), labels.tolist(), strict=True):
        pairs = {}
        for t in row_tokens[:5]:
            key, value = divmod(t - task.pair_offset, 6)
            assert 0 <= key < 7 and 0 <= value < 6
            pairs[key] = value
        assert len(pairs) == 5  # distinct keys
        for t, label in zip(row_tokens[5:], row_labels[5:], strict=True):
            assert label == pairs[t - task.key_offset]
        assert all(label == -100 for label in row_labels[:5])
