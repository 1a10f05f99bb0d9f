"""``compile=true``: training steps under ``torch.compile``, with the guarantees of eager runs. Two compiled runs of
the same seed agree bit for bit (one of them in another process, where inductor loads or rebuilds its kernels), and
so do the gradients of repeated compiled steps on two threads; a compiled run crashed twice and resumed ends as the
uninterrupted one; its checkpoint loads into an eager model with the same keys and gives its results; a resume may
not switch compile on or off; where torch.compile cannot run, or fails on the model, the run trains eagerly after one
warning line; and a bad value is one line.

The runs are tiny (d_model 32, 30 steps, one thread); 120 training sequences in batches of 16 make an epoch's last
batch shorter (8), so that two batch shapes are compiled and a resume meets them in another order than the
uninterrupted run. Inductor's on-disk cache makes every compile after the first on a machine a few seconds. Every
test that compiles is marked slow (inductor runs the C++ compiler in subprocesses, for minutes on a cold cache).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from helpers import REPO, read_summary, train_env
from hydra import compose
from test_resume import SMALL, _CrashAt, assert_same_run, weights_of

import attnlab.callbacks
import attnlab.module
from attnlab import training as T
from attnlab.module import EncoderModule
from attnlab.training.config import ConfigError, build_module, validate_config

pytestmark = pytest.mark.usefixtures("restore_process_state")

# test_resume's small run, with a shorter last batch per epoch, compiled, on one thread (inductor builds its kernels for
# a thread count: the runs compared use the same; the two-thread kernels are checked below, on gradients)
COMPILED = (
    *(o for o in SMALL if not o.startswith("task.datamodule.num_train=")),
    "task.datamodule.num_train=120",
    "threads=1",
    "compile=true",
)


@pytest.fixture
def deterministic_flags():
    """torch's deterministic-algorithms flags, put back afterwards."""
    before = attnlab.module.deterministic_flags()
    yield
    attnlab.module.set_deterministic_flags(before)


@pytest.fixture(scope="module")
def compiled_reference(hydra_ctx: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted compiled run, in this process."""
    from torch._dynamo.utils import counters

    counters.clear()
    out = tmp_path_factory.mktemp("compiled") / "run"
    threads, uid, limit = torch.get_num_threads(), os.environ.get("ATTNLAB_UID"), torch._dynamo.config.recompile_limit
    try:
        T.run(compose("config", overrides=list(COMPILED)), out)
    finally:  # (a module fixture: the per-test restore_process_state does not cover it)
        torch.set_num_threads(threads)
        torch._dynamo.config.recompile_limit = limit
        if uid is None:
            os.environ.pop("ATTNLAB_UID", None)
        else:
            os.environ["ATTNLAB_UID"] = uid
    assert read_summary(out)["status"] == "ok", read_summary(out).get("reason")
    assert [segment["compiled"] for segment in read_summary(out)["segments"]] == [True]
    # two training shapes (16 and the last batch's 8), three graphs each (the embedding, the layers, the head), and
    # the toolchain's probe: validation, test and the diagnostics probe batch run eagerly and compile nothing
    assert counters["stats"]["unique_graphs"] <= 7, dict(counters["stats"])
    assert not torch.are_deterministic_algorithms_enabled()  # turned on for the run, and off again after it
    return out


@pytest.mark.slow
def test_compiled_runs_of_the_same_seed_agree_bit_for_bit_across_processes(
    compiled_reference: Path, tmp_path: Path
) -> None:
    run = tmp_path / "again"
    proc = subprocess.run(
        [sys.executable, "train.py", *COMPILED, f"hydra.run.dir={run}"],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line for line in lines if line.startswith("compile=true: ")], proc.stdout  # said once, at the start
    assert_same_run(compiled_reference, run)  # metrics, diagnostics, metrics.jsonl rows and weights, exactly


@pytest.mark.slow
def test_compiled_gradients_on_two_threads_are_the_same_every_time(deterministic_flags: None) -> None:
    """With more than one thread, inductor's backward of the embedding adds into the rows of its gradient with
    atomics, in an order that varies (19 different gradients in 20 steps here): compile_forward turns on torch's
    deterministic algorithms, which keep aten's index_put instead."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    module = EncoderModule(17, 10, per_token=False, pad_id=0, max_len=64, d_model=32, num_heads=4, num_layers=1)
    module.compile_forward()
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(1, 17, (16, 64), generator=generator), torch.randint(0, 10, (16,), generator=generator)
    gradients = set()
    for _ in range(10):
        module.zero_grad()
        module._loss(batch)[0].backward()
        flat = torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])
        gradients.add(flat.numpy().tobytes())
    assert len(gradients) == 1


@pytest.mark.slow
def test_compiled_run_crashed_twice_resumes_to_the_uninterrupted_result(
    compiled_reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Crash at step 15 (resumed from 12, mid-epoch), then at 26 (resumed from 24, an epoch's end): each start
    compiles afresh, and the last batch of an epoch (8 sequences) comes at other steps after each start."""
    out = tmp_path / "run"
    monkeypatch.setattr(attnlab.callbacks, "DivergenceGuard", _CrashAt)
    monkeypatch.setattr(_CrashAt, "steps", [15, 26])
    assert math.isnan(T.run(compose("config", overrides=list(COMPILED)), out))
    assert "simulated crash at step 15" in read_summary(out)["reason"]
    T.run(compose("config", overrides=[*COMPILED, "resume=true"]), out)
    assert read_summary(out)["resumed_at_step"] == 12 and "simulated crash at step 26" in read_summary(out)["reason"]
    T.run(compose("config", overrides=[*COMPILED, "resume=true"]), out)
    assert read_summary(out)["resumed_at_step"] == 24
    assert_same_run(compiled_reference, out)


@pytest.mark.slow
def test_a_compiled_runs_checkpoint_loads_without_compile_and_gives_its_results(compiled_reference: Path) -> None:
    state = weights_of(compiled_reference / "checkpoints" / "best.ckpt")
    cfg = compose("config", overrides=[o for o in COMPILED if o != "compile=true"])
    datamodule = validate_config(cfg)
    datamodule.setup("fit")
    eager, compiled = build_module(cfg, datamodule), build_module(cfg, datamodule)
    compiled.compile_forward(deterministic=False)  # (a closeness check: leaves torch's flags alone)
    for module in (eager, compiled):
        module.load_state_dict(state)  # strict: compiling in place keeps every key
        assert module.state_dict().keys() == state.keys()
    assert compiled.compiled and not eager.compiled

    tokens, labels = datamodule.tensors("test")
    eager.eval()
    with torch.no_grad():
        accuracy = (eager(tokens).argmax(-1) == labels).float().mean().item()
    assert accuracy == pytest.approx(read_summary(compiled_reference)["metrics"]["test/acc"], abs=1e-6)

    batch = datamodule.tensors("val")[0][:16]
    eager.train(), compiled.train()
    with torch.no_grad():
        # the compiled training forward computes the same function; inductor fuses, so the last bits may differ
        torch.testing.assert_close(compiled(batch), eager(batch), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "kernel"),
    [("additive", "attnlab::additive_logits"), ("relative_position", "attnlab::tiled_attention")],
)
def test_fused_kernels_compile_into_the_graph_on_their_first_use_in_the_process(
    hydra_ctx: None, deterministic_flags: None, monkeypatch: pytest.MonkeyPatch, variant: str, kernel: str
) -> None:
    """attnlab's fused kernels are custom operators inside the compiled graph, with the mask's single graph break and
    no other, also when the trial step is the kernel's first use in the process (its library is loaded, or built,
    then: traced, that file-system work broke the graph inside the layer loop, and Dynamo ran the layers eagerly)."""
    from torch._dynamo.utils import counters

    from attnlab.kernels import additive, relative

    library = {"additive": additive, "relative_position": relative}[variant]._LIBRARY
    if library.get() is None:
        pytest.skip(f"the fused kernel is not available here: {library.error}")
    monkeypatch.setattr(library, "_tried", False)  # not loaded yet in this process
    monkeypatch.setattr(library, "_lib", None)
    cfg = compose("config", overrides=[f"variant={variant}", "d_model=32", "num_layers=2", "threads=1"])
    datamodule = validate_config(cfg)
    datamodule.setup("fit")
    module = build_module(cfg, datamodule)
    tokens, labels = datamodule.tensors("train")
    counters.clear()
    assert module.compile_forward((tokens[:8], labels[:8]), deterministic=False) is None
    breaks = [reason for reason in counters["graph_break"] if "Encoder.build_mask" not in reason]
    assert not breaks, breaks[0][:300]
    assert counters["stats"]["unique_graphs"] == 3  # embedding, then the layers and the head: one shape, no skips
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        module._loss((tokens[:8], labels[:8]))[0].backward()
    names = {event.name for event in profile.events()}
    assert kernel in names and f"{kernel}_backward" in names, sorted(n for n in names if "attnlab" in n)


@pytest.mark.slow
def test_a_resume_cannot_switch_compile(compiled_reference: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "copy"
    shutil.copytree(compiled_reference, run)
    overrides = [o for o in COMPILED if o != "compile=true"]
    assert math.isnan(T.run(compose("config", overrides=[*overrides, "compile=false", "resume=true"]), run))
    assert "compile: True → False" in capsys.readouterr().err


def _short_run(out: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A compile=true run of 6 steps in ``out`` that trained eagerly, with torch's deterministic algorithms as they
    were; the lines it printed that start with ``warning:``."""
    flags = []
    training_step = EncoderModule.training_step

    def recording(self, batch, batch_idx):
        flags.append((torch.are_deterministic_algorithms_enabled(), self.compiled))
        return training_step(self, batch, batch_idx)

    monkeypatch.setattr(EncoderModule, "training_step", recording)
    overrides = [o for o in COMPILED if not o.startswith(("max_steps=", "eval_every="))]
    T.run(compose("config", overrides=[*overrides, "max_steps=6", "eval_every=6"]), out)
    assert read_summary(out)["status"] == "ok", read_summary(out).get("reason")
    assert [segment["compiled"] for segment in read_summary(out)["segments"]] == [False]
    assert flags == [(False, False)] * 6  # eager steps, deterministic algorithms off (as before the run)
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]


def test_where_torch_compile_cannot_run_the_run_trains_eagerly_after_one_warning(
    hydra_ctx: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(attnlab.module._compile_problems, "cpu", "InvalidCxxCompiler: No working C++ compiler found")
    monkeypatch.setattr(EncoderModule, "compile_forward", lambda *args, **kwargs: pytest.fail("compiled"))
    assert _short_run(tmp_path / "run", capsys, monkeypatch) == [
        "warning: compile=true, but torch.compile fails here (InvalidCxxCompiler: No working C++ compiler found); "
        "training eagerly"
    ]


@pytest.mark.slow
def test_a_model_that_does_not_compile_trains_eagerly_after_one_warning(
    hydra_ctx: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trial step on a training batch fails (as a custom op with a wrong fake kernel does): eager again."""
    loss = EncoderModule._loss

    def failing_when_compiled(self, batch):
        if self.compiled:
            raise RuntimeError("expected size 16==16, stride 4096==1024 at dim=0\nError in op: mylib.op.default")
        return loss(self, batch)

    monkeypatch.setattr(EncoderModule, "_loss", failing_when_compiled)
    assert _short_run(tmp_path / "run", capsys, monkeypatch) == [
        "warning: compile=true, but torch.compile fails here (RuntimeError: expected size 16==16, stride 4096==1024 "
        "at dim=0 Error in op: mylib.op.default); training eagerly"
    ]


@pytest.mark.slow
def test_a_resume_that_compiles_where_the_run_fell_back_says_its_numbers_mix_the_two(
    hydra_ctx: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Started where torch.compile could not run (eager after a warning), crashed, resumed where it can: the
    segments record each part, and the resume says so in one warning line."""
    out = tmp_path / "run"
    monkeypatch.setattr(attnlab.callbacks, "DivergenceGuard", _CrashAt)
    monkeypatch.setattr(_CrashAt, "steps", [15])
    with monkeypatch.context() as patch:
        patch.setitem(attnlab.module._compile_problems, "cpu", "InvalidCxxCompiler: No working C++ compiler found")
        assert math.isnan(T.run(compose("config", overrides=list(COMPILED)), out))
    capsys.readouterr()
    T.run(compose("config", overrides=[*COMPILED, "resume=true"]), out)
    assert read_summary(out)["status"] == "ok", read_summary(out).get("reason")
    assert [segment["compiled"] for segment in read_summary(out)["segments"]] == [False, True]
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        "warning: this part of the run trains compiled, its earlier part eagerly: its numbers mix the two "
        "(compiled numbers are not eager numbers)"
    ]


def test_compile_problem_reports_a_broken_toolchain_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler.\nPlease specify via CC environment variable.")

    monkeypatch.setattr(attnlab.module, "_compile_problems", {})
    monkeypatch.setattr(torch, "compile", broken)
    assert attnlab.module.compile_problem("cpu") == "RuntimeError: Failed to find C compiler."


def test_compile_is_off_by_default_for_runs_and_for_every_study(hydra_ctx: None) -> None:
    assert compose("config").compile is False
    experiments = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
    assert len(experiments) >= 5
    assert [e for e in experiments if compose("config", overrides=[f"experiment={e}"]).compile is not False] == []


@pytest.mark.parametrize("value", ["yes", "1", "default", "[true]"])
def test_compile_takes_true_or_false_only(hydra_ctx: None, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validate_config(compose("config", overrides=[f"compile={value}"]))
    message = str(caught.value)
    assert message.startswith("compile must be true or false, got ") and "\n" not in message
