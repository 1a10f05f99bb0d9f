"""Bad values are refused before anything is written (issue 40): one ``error: `` line on stderr naming the key and
what is allowed, exit code 2, and no run folder (the one Hydra made is gone again). Each value here escaped the
checks before: it trained for ever (``max_tokens=1e30``), ran out of memory after writing its folder (a linear
state of 1.4e12 floats per sequence), hung in the pruning step (``diagnostics.random_orders=1e9``), was taken
silently (``model.short_conv=0``, ``+diagnostics.foo``, ``resample=maybe``), crashed with a message naming no key
(``model.layers=5``), left a folder behind (a forced ``attention.backend=flex`` on a CPU training run), or printed
Hydra's lexer traceback (an unquoted non-ASCII value). The command line runs in this process (:func:`run_cli`),
one as a real ``python train.py``."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import run_cli, run_train

from attnlab.training.config import ConfigError, check_override_text

_LINEAR_STATE = ["variant=linear", "variant.params.feature_map=taylor", "+variant.params.feature_dim=100000"]

REFUSED = [
    # 1. sizes: the budget, the recurrent state, the pruning step
    (
        ["max_tokens=1e30"],
        r"^error: max_tokens=1e\+30 makes 9\.77e\+26 steps of 1,024 tokens .* more than the 1,000,000,000 steps a run "
        r"may take; allowed: null or an integer from 1 to 1,024,000,000,000$",
    ),
    (["max_steps=10000000000"], r"^error: max_steps must be an integer in \[1, 1000000000\], got 10000000000$"),
    (
        _LINEAR_STATE,
        r"^error: variant\.name=linear variant\.params\.feature_map=taylor variant\.params\.feature_dim=100000 .*: "
        r"the layers' state is 1,360,013,600,136 floats per sequence .* more than the [\d.]+ GiB of memory here",
    ),
    (
        ["diagnostics.random_orders=1e9"],
        r"^error: diagnostics\.random_orders must be an integer from 0 to 1,000 \(each random order costs the pruning "
        r"step 8 more passes over the test set.*\), got 1,000,000,000$",
    ),
    # 2. values taken silently
    (["model.short_conv=0"], r"^error: model\.short_conv must be null \(off\) or an integer >= 1 \(the width .*got 0$"),
    (
        ["+diagnostics.random_order=3"],
        r"^error: diagnostics\.random_order is not a diagnostics setting \(did you mean diagnostics\.random_orders\? "
        r"allowed: enabled, .*random_orders\)$",
    ),
    (["task=listops", "task.datamodule.resample=maybe"], r"^error: task\.datamodule\.resample must be true or false"),
    # 3. per-layer changes of the wrong shape
    (["model.layers=5"], r"^error: model\.layers must be null or a list of one mapping of attention fields per layer"),
    (["model.layer_kinds.L=5"], r"^error: model\.layer_kinds\.L must be a mapping of attention fields .*, got 5$"),
    (["model.layers=[abc, {}]"], r"^error: model\.layers\[0\] must be a mapping of attention fields .*, got 'abc'$"),
    (["+model.layer_kinds.L.windw=3"], r"^error: model\.layer_kinds\.L: attention has no field 'windw'; fields: "),
    # 5. text Hydra's grammar cannot read (the check runs before Hydra)
    (["task.name=é"], r"""^error: cannot read the override 'task\.name=é': .*'é' .*the value: "task\.name='é'"$"""),
]
if not torch.cuda.is_available():  # 4. a forced backend that cannot train here (FlexAttention: no CPU backward)
    REFUSED += [
        (["attention.backend=flex"], r"^error: attention\.backend=flex cannot run here: CPU FlexAttention .* on cpu"),
        (["attention.backend=flex", "variant=diff"], r"^error: attention\.backend=flex cannot run here: CPU Flex"),
        (  # a C kernel that computes float32/64 only, under CPU bf16 autocast (issue 40's bf16 item)
            ["variant=t5_bias", "attention.backend=relative", "trainer.precision=bf16-mixed"],
            r"^error: attention\.backend=relative cannot run here: it computes float32 and float64, not torch\.bf",
        ),
    ]


def _ids(value: object) -> str:
    return "_".join(value) if isinstance(value, list) else ""


def _assert_refused(proc, message: str, folder) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and re.search(message, lines[0]), proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert list(folder.iterdir()) == [], sorted(str(p) for p in folder.rglob("*"))


@pytest.mark.parametrize(("overrides", "message"), REFUSED, ids=_ids)
def test_a_bad_value_is_refused_in_one_line_before_anything_is_written(tmp_path, overrides, message):
    """Started in an empty folder with the default run folder (outputs/<date>/<time>_<id>), which Hydra makes before
    the run sees its config: it must be gone again, with its parents."""
    proc = run_cli("logger=none", "debug=fast", *overrides, cwd=tmp_path)
    _assert_refused(proc, message, tmp_path)


@pytest.mark.slow
def test_a_linear_state_that_cannot_fit_is_refused_by_the_real_command(tmp_path):
    proc = run_train("logger=none", "debug=fast", *_LINEAR_STATE, cwd=tmp_path)
    _assert_refused(proc, REFUSED[2][1], tmp_path)


def test_a_refused_value_leaves_an_existing_run_folder_as_it_was(tmp_path):
    """``hydra.run.dir`` named and already there (with a file of the user's): nothing in it changes."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    proc = run_cli("logger=none", "debug=fast", "model.short_conv=0", f"hydra.run.dir={run}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"] and (run / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "overrides",
    [
        ["diagnostics.random_orders=1000"],  # the most a model of 8 heads may ask for
        ["model.short_conv=4"],
        ["model.pattern=LG", "model.layer_kinds.L=null"],
        ["model.layers=[{mask: causal}, null]"],
        ["task=listops", "task.datamodule.resample=true"],
        ["max_tokens=1e6"],
        ["task.name='digits'"],
    ],
    ids=_ids,
)
def test_the_values_next_to_the_refused_ones_are_taken(overrides):
    """The other side of each bound: these pass the whole check (composed and validated, nothing run)."""
    from hydra import compose, initialize_config_dir

    from attnlab.training.config import CONF_DIR, validate_config

    check_override_text(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "debug=fast", *overrides])
    validate_config(cfg)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["task.name=é"], r"Hydra's grammar takes no 'é' \(U\+00E9\) in an unquoted value"),
        (["lr=1e-3", "+tag=a#b"], r"cannot read the override '\+tag=a#b': .*no '#' .*\"\+tag='a#b'\""),
        (["lr=[1,2"], r"^cannot read the override 'lr=\[1,2': no viable alternative"),
    ],
)
def test_override_text_that_hydra_cannot_read_is_one_line(args, message):
    with pytest.raises(ConfigError, match=message) as err:
        check_override_text(args)
    assert "\n" not in str(err.value)


def test_override_text_check_takes_what_hydra_takes():
    check_override_text(["-m", "--cfg", "job", "--config-name", "config", "task.name='é'", "+a.b=1", "~x", "d=a b"])
