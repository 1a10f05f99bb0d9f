"""Tests of the byte-level language-modelling task ``text`` (attnlab.tasks.text): labels and held-out topics checked by
independent code, seeds and epochs, lengths, argument errors, the causal-leak test through the whole module built
from a composed config, and one ``python train.py task=text debug=fast`` smoke run."""

from __future__ import annotations

import collections
import functools
import math
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import helpers
import numpy as np
import pytest
import torch
from helpers import NORMALIZERS, POSITION_BIASES, SCORES, compose_cfg, read_summary, run_train
from hydra.utils import instantiate

from attnlab.tasks import TASKS, TextLM, build_task
from attnlab.tasks.text import split_text, split_topics
from attnlab.training.config import ConfigError, build_module, validate_config

SPLITS = ("train", "val", "test")
SMALL: dict[str, Any] = dict(seq_len=32, num_train=200, num_val=50, num_test=50, batch_size=16)


small = functools.partial(helpers.small, "text", SMALL)  # small(**kwargs): a set-up TextLM


def text_of(split: str) -> bytes:
    """The split's text rebuilt here from pydoc_data and the split's topic names."""
    return b"\n\n".join(topics[name].encode("utf-8") for name in sorted(split_topics()[split]))


def runs(text: bytes, length: int) -> set[bytes]:
    return {text[i : i + length] for i in range(len(text) - length + 1)}


# ---------------------------------------------------------------- labels and text, by plain loops


def test_registered_with_lm_attributes() -> None:
    assert TASKS["text"] is TextLM and isinstance(build_task("text", **SMALL), TextLM)
    task = small()
    assert (task.vocab_size, task.num_classes, task.pad_id, task.per_token) == (257, 256, 0, True)
    assert task.reports_bits is True and task.requires_causal is True
    assert task.length_keys == ("seq_len",) and task.seq_len == task.max_len == 32
    assert "\n" not in task.describe() and "text" in task.describe()


def test_labels_are_the_next_byte_and_windows_are_substrings_of_their_split() -> None:
    task = small()
    for split in SPLITS:
        text = text_of(split)
        assert split_text(split) == text
        tokens, labels = task.tensors(split)
        assert tokens.shape == labels.shape == (task.split_size(split), 32)
        for row_tokens, row_labels in zip(tokens.tolist(), labels.tolist(), strict=True):
            assert all(1 <= tok <= 256 for tok in row_tokens)  # never PAD
            for t in range(len(row_tokens) - 1):
                assert row_labels[t] == row_tokens[t + 1] - 1
            window = bytes(tok - 1 for tok in row_tokens) + bytes([row_labels[-1]])  # L + 1 bytes of text
            assert window in text, split


def test_held_out_topics_are_disjoint_and_share_no_window_with_training() -> None:
    names = {split: set(split_topics()[split]) for split in SPLITS}
    assert not names["train"] & names["val"] and not names["train"] & names["test"] and not names["val"] & names["test"]
    assert names["train"] | names["val"] | names["test"] == set(topics)
    sizes = {split: len(split_text(split)) for split in SPLITS}
    total = sum(sizes.values())
    assert 0.7 < sizes["train"] / total < 0.9 and sizes["val"] / total > 0.05 and sizes["test"] / total > 0.05
    # no 48-byte run of a held-out topic occurs in a training topic (why the split groups topics)
    train_runs = set().union(*(runs(topics[name].encode(), 48) for name in names["train"]))
    for split in ("val", "test"):
        for name in names[split]:
            assert not runs(topics[name].encode(), 48) & train_runs, (split, name)
    # and no window of the default length (128 tokens + the last label) of held-out text is in the training text
    train_windows = runs(split_text("train"), 129)
    for split in ("val", "test"):
        assert not runs(split_text(split), 129) & train_windows, split


def test_held_out_windows_tile_their_text() -> None:
    """With the defaults, the validation windows sit at increasing, evenly spaced offsets (located here by search)
    and read about 97% of the validation text."""
    task = TextLM()
    task.setup()
    text = split_text("val")
    tokens, labels = task.tensors("val")
    offsets, start = [], 0
    for row_tokens, row_labels in zip(tokens.tolist(), labels.tolist(), strict=True):
        window = bytes(tok - 1 for tok in row_tokens) + bytes([row_labels[-1]])
        start = text.find(window, start)
        assert start >= 0
        offsets.append(start)
        start += 1
    stride = (len(text) - task.seq_len) / task.num_val
    gaps = np.diff(offsets)
    assert gaps.min() >= math.floor(stride) and gaps.max() <= math.ceil(stride)
    covered = np.zeros(len(text), dtype=bool)
    for offset in offsets:
        covered[offset : offset + task.seq_len + 1] = True
    assert covered.mean() > 0.95


def test_chance_accuracy_is_the_most_frequent_training_byte() -> None:
    counts = collections.Counter(split_text("train"))
    byte, count = counts.most_common(1)[0]
    assert byte == ord(" ")
    task = small()
    assert task.chance_accuracy == pytest.approx(count / sum(counts.values()))
    assert 0.0 < task.chance_accuracy < 0.5 and 0.0 < task.unigram_bpc < 8.0


# ---------------------------------------------------------------- seeds, epochs, lengths


def test_same_seed_same_windows_other_seed_other_windows() -> None:
    a, b, c = small(seed=3), small(seed=3), small(seed=4)
    for split in SPLITS:
        assert torch.equal(a.tensors(split)[0], b.tensors(split)[0])
        assert torch.equal(a.tensors(split)[1], b.tensors(split)[1])
        assert not torch.equal(a.tensors(split)[0], c.tensors(split)[0]), split


def test_resample_draws_new_training_windows_each_epoch() -> None:
    task = small(seed=1)
    val = task.tensors("val")[0].clone()
    task.set_epoch(0)
    first = task.tensors("train")[0].clone()
    task.set_epoch(1)
    second = task.tensors("train")[0].clone()
    assert not torch.equal(first, second)
    assert torch.equal(task.tensors("val")[0], val)
    task.set_epoch(0)
    assert torch.equal(task.tensors("train")[0], first)  # epoch e's windows depend on (seed, e) only
    fixed = small(seed=1, resample=False)
    before = fixed.tensors("train")[0].clone()
    fixed.set_epoch(1)
    assert torch.equal(fixed.tensors("train")[0], before)


def test_test_lengths_give_longer_test_windows() -> None:
    task = small(seq_len=16, test_lengths=[48, 8])
    assert task.max_len == 48 and task.seq_len == 16
    test_text = split_text("test")
    for length in (48, 8):
        tokens, labels = task.length_tensors(length)
        assert tokens.shape == labels.shape == (task.num_test, length)
        assert torch.equal(labels[:, :-1], tokens[:, 1:] - 1)
        for row_tokens, row_labels in zip(tokens.tolist(), labels.tolist(), strict=True):
            assert bytes(tok - 1 for tok in row_tokens) + bytes([row_labels[-1]]) in test_text
    loaders = task.test_dataloader()
    assert isinstance(loaders, list) and len(loaders) == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(seq_len=0), "seq_len must be an integer >= 1, got 0"),
        (dict(seq_len="64"), "seq_len must be an integer >= 1, got '64'"),
        (dict(seq_len=10**6), "seq_len must be <= "),
        (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
        (dict(num_val=0), "num_val must be an integer >= 1, got 0"),
        (dict(seed=-1), "seed must be an integer >= 0, got -1"),
        (dict(test_lengths=[0]), "test_lengths[] must be an integer >= 1, got 0"),
        (dict(test_lengths=[64, 64]), "test_lengths has a length twice"),
        (dict(test_lengths=[10**6]), "test_lengths must be <= "),
    ],
)
def test_bad_arguments_raise_one_line_value_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        TextLM(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- no peeking at the next byte, through the module


SMALL_RUN = (
    "task=text",
    "task.datamodule.seq_len=24",
    "task.datamodule.num_train=64",
    "task.datamodule.num_val=16",
    "task.datamodule.num_test=16",
    "d_model=32",
    "num_heads=4",
    "num_layers=2",
    "logger=none",
)

# attention stages that could carry information across positions: every one must respect the causal mask (every
# registered score, normalizer and position bias besides the defaults, scaled_dot, softmax and none; and the presets)
STACKS = [
    [],
    *([f"variant={name}"] for name in SCORES if name != "scaled_dot"),
    ["variant=rope"],
    ["variant=diff"],
    *([f"normalizer={name}"] for name in NORMALIZERS if name != "softmax"),
    *([f"position_bias={name}"] for name in POSITION_BIASES if name != "none"),
    ["num_kv_heads=1", "qk_norm=rmsnorm", "softcap=5.0"],
    ["mask=causal_window"],
]


def module_for(*overrides: str, validate: bool = True) -> tuple[torch.nn.Module, torch.Tensor]:
    """The module a run builds for the composed config (validated as train.py does), in float64 eval mode, and a
    few validation windows."""
    cfg = compose_cfg(*SMALL_RUN, *overrides)
    datamodule = validate_config(cfg) if validate else instantiate(cfg.task.datamodule)
    torch.manual_seed(0)
    module = build_module(cfg, datamodule).double().eval()
    datamodule.setup()
    return module, datamodule.tensors("val")[0][:3]


def changed_after(tokens: torch.Tensor, t: int) -> torch.Tensor:
    """``tokens`` with every position after ``t`` replaced by a different byte."""
    other = tokens.clone()
    byte = tokens[:, t + 1 :] - 1
    other[:, t + 1 :] = (byte + 1 + torch.arange(byte.shape[1])) % 256 + 1  # shifted by 1..L-t-1 < 256
    assert (other[:, t + 1 :] != tokens[:, t + 1 :]).all()
    return other


@pytest.mark.parametrize("stack", STACKS, ids=lambda s: "-".join(s) or "default")
def test_logits_at_t_ignore_every_later_token(hydra_ctx: None, stack: list[str]) -> None:
    mask = [] if any(o.startswith("mask=") for o in stack) else ["mask=causal"]
    module, tokens = module_for(*mask, *stack)
    length = tokens.shape[1]
    with torch.no_grad():
        logits = module(tokens)
        assert logits.dtype == torch.float64 and logits.shape == (*tokens.shape, 256)
        for t in (0, 1, length // 2, length - 2):
            changed = module(changed_after(tokens, t))
            before = (changed[:, : t + 1] - logits[:, : t + 1]).abs().max().item()
            after = (changed[:, t + 1 :] - logits[:, t + 1 :]).abs().max().item()
            assert before < 1e-12, f"t={t}: logits at positions <= t moved by {before:.3g}"
            assert after > 1e-6, f"t={t}: later logits did not change"


def test_the_leak_test_sees_a_bidirectional_model(hydra_ctx: None) -> None:
    """Positive control: built with ``mask=none`` (bypassing the config check), position t reads token t+1, which
    is its label, and the logits at t move when a later token changes."""
    module, tokens = module_for("mask=none", validate=False)
    with torch.no_grad():
        moved = (module(changed_after(tokens, 4))[:, :5] - module(tokens)[:, :5]).abs().max().item()
    assert moved > 1e-6


def test_task_text_trains_with_the_causal_mask_by_default(hydra_ctx: None) -> None:
    assert compose_cfg("task=text").mask.name == "causal"
    assert compose_cfg("task=text", "mask=causal_window").mask.name == "and"  # the user's choice still wins
    assert compose_cfg("task=digits").mask.name == "none"


@pytest.mark.parametrize("mask", ["none", "sliding_window"])
def test_non_causal_masks_are_refused_for_text(hydra_ctx: None, mask: str) -> None:
    with pytest.raises(ConfigError, match="causal"):
        validate_config(compose_cfg(*SMALL_RUN, f"mask={mask}"))


# ---------------------------------------------------------------- one real run


@pytest.mark.slow
def test_train_py_task_text_smoke_run_reports_bits(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["task=text", "mask=causal", "debug=fast", "logger=none", "threads=1", f"hydra.run.dir='{out}'"]
    run_train(*args, wandb="disabled", full_error=True, returncode=0)
    summary = read_summary(out)
    assert summary["status"] == "ok" and summary["task"] == "text" and summary["mask"] == "causal"
    metrics = summary["metrics"]
    assert 0.0 <= metrics["test/acc"] <= 1.0
    assert metrics["test/bpc"] == pytest.approx(metrics["test/loss"] / math.log(2), rel=1e-5)  # bits per byte
    assert 0.0 < metrics["val/bpc"] < 9.0
