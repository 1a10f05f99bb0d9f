"""The attention stages from the command line: every normalizer and preset (rope, cosine, diff) trains to status ok
under ``debug=fast`` and its diagnostics say what the normalizer is (row mass, support, negative mass); the issue's
multirun over normalizer × num_kv_heads × pos_encoding; a position bias on any score; T5's buckets under a causal
mask; a normalizer of the user's own through ``imports``; and bad values as one line with exit code 2.

The ``python train.py`` subprocesses are few (one Hydra multirun per group of choices) and start two at a time from
module-scoped fixtures (the machine has 2 cores and every subprocess runs one thread), so the first test that needs
them pays for all of them. Every run folder goes to tmp_path.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import helpers
import pytest
from helpers import (
    REPO,
    SUBPROCESS_TIMEOUT,
    compose_cfg,
    read_summary,
    run_cli,
    run_folders,
    train_cmd,
)
from omegaconf import OmegaConf
from test_cli import assert_one_error_line
from test_train import files_in_default_run_places, subprocess_env

from attnlab.normalizers import _NORMALIZERS
from attnlab.position_bias import T5Bias
from attnlab.runs import read_metrics
from attnlab.training.config import (
    ConfigError,
    build_module,
    check_group_choices,
    import_user_modules,
    validate_config,
)

# every registered built-in normalizer but the default, softmax, which every other run trains with
# the softmax's alternatives on the default score (linear attention's rowsum and none, which need non-negative
# logits, train in test_linear_training.py with variant=linear)
NORMALIZERS = tuple(  # (stick-breaking is causal only: variant=stickbreaking, tests/test_forgetting_stickbreaking.py)
    name
    for name in helpers.NORMALIZERS
    if name != "softmax"
    and name not in helpers.LINEAR_NORMALIZERS
    and not getattr(_NORMALIZERS.get(name), "causal_only", False)
)
PRESETS = ("rope", "cosine", "diff", "additive")  # additive: a score without a preset, for position_bias=alibi
BIASES = ("none", "alibi")
SUM_TO_ONE = {"softmax", "sparsemax", "entmax15"}  # row mass exactly 1 (a probability distribution per row)
BELOW_ONE = {"softmax1", "sink", "softpick"}  # mass can leak to "nothing": row mass < 1
DENSE = {"softmax", "softmax1", "sink", "sigmoid"}  # every visible key gets weight > 0: support exactly 1
SPARSE = {"sparsemax", "entmax15", "softpick"}  # exact zeros: support < 1
ISSUE_SWEEP = ("normalizer=softmax,sigmoid", "num_kv_heads=1,4", "model.pos_encoding=rope,sinusoidal")
CUSTOM_MASS = 0.5  # the user's normalizer scales a softmax by this: its row mass proves that it ran


# ------------------------------------------------------------------------------------ helpers


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)


def run_two_at_a_time(commands: dict[str, tuple[list[str], Path, dict[str, str]]]) -> dict[str, object]:
    """Run every (argv, cwd, env) in ``commands``, two at a time, in the order given (longest first is best)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, *command) for name, command in commands.items()}
        return {name: future.result() for name, future in futures.items()}


def failure(proc: subprocess.CompletedProcess) -> str:
    return f"train.py {' '.join(proc.args[2:])} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def jobs_of(sweep: Path, count: int) -> dict[tuple[str, ...], Path]:
    """The job folders of a sweep keyed by their overrides ``key=value`` without debug/logger, e.g.
    ``("normalizer=sink",)``; there must be ``count`` of them."""
    folders = run_folders(sweep)
    assert len(folders) == count, [f.name for f in folders]
    jobs = {}
    for folder in folders:
        summary = read_summary(folder)
        key = tuple(o for o in summary["overrides"] if not o.startswith(("debug=", "logger=")))
        jobs[key] = folder
    return jobs


def assert_ok_and_finite(summary: dict, folder: Path) -> None:
    assert summary["status"] == "ok", (folder.name, summary["status"], summary.get("reason"))
    assert summary["steps"] == 5 and summary["smoke"] is True
    values = {**summary["metrics"], **{f"init {k}": v for k, v in summary["attn_init"].items()}}
    signed = summary["metrics"].get("attn/signed") == 1  # every layer's weights signed: no entropy (issue 60)
    probability = ("entropy", "entropy_norm", "saturation", "max_prob")
    if signed:
        values = {k: v for k, v in values.items() if k.rsplit("/", 1)[-1] not in probability}
    bad = {k: v for k, v in values.items() if not (isinstance(v, float | int) and math.isfinite(v))}
    assert not bad, (folder.name, bad)
    required = ("train/loss", "val/acc_best", "test/acc", "attn/row_mass", "attn/support")
    for key in (*required, *(() if signed else ("attn/entropy",))):
        assert key in summary["metrics"], (folder.name, key, sorted(summary["metrics"]))
    assert (folder / "attention" / "maps.png").is_file(), folder.name


def per_head(folder: Path, metric: str) -> list[float]:
    """Every ``attn/L{l}H{h}/{metric}`` value that the run logged (step 0 and the end)."""
    values = [
        v
        for row in read_metrics(folder)
        for k, v in row.items()
        if k.startswith("attn/L") and "H" in k.split("/")[1] and k.endswith("/" + metric)
    ]
    assert values, (folder.name, metric)
    return values


def assert_negative_mass(summary: dict, folder: Path, differential: bool) -> None:
    keys = [k for row in read_metrics(folder) for k in row if k.endswith("/negative_mass")]
    if differential:
        assert summary["metrics"]["attn/negative_mass"] >= 0 and summary["attn_init"]["attn/negative_mass"] >= 0
        assert keys, folder.name
    else:
        assert "attn/negative_mass" not in summary["metrics"] and "attn/negative_mass" not in summary["attn_init"]
        assert not keys, (folder.name, keys[:3])


PLUGIN = """\
import torch

import attnlab


@attnlab.register_normalizer("{name}")
def scaled_softmax(logits, allowed, mass: float = 1.0):
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return mass * torch.softmax(logits, dim=-1).nan_to_num(0.0)
"""


# ------------------------------------------------------------------------------------ the training subprocesses


@pytest.fixture(scope="module")
def training_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Four ``train.py`` launches, two at a time: the normalizer sweep, the preset × position-bias sweep, the issue's
    sweep and the user-normalizer run. Maps name → (process, sweep or run folder)."""
    root = tmp_path_factory.mktemp("variants_cli")
    tag = uuid.uuid4().hex[:8]
    module_name, norm_name = f"attnlab_test_normalizer_{tag}", f"test_scaled_softmax_{tag}"
    (root / f"{module_name}.py").write_text(PLUGIN.format(name=norm_name))
    plugin_env = subprocess_env(PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    common = ("debug=fast", "logger=none")
    folders = {name: root / name for name in ("presets", "issue", "normalizers", "custom")}
    argv = {
        "presets": ["-m", f"variant={','.join(PRESETS)}", f"position_bias={','.join(BIASES)}"],
        "issue": ["-m", *ISSUE_SWEEP],
        "normalizers": ["-m", f"normalizer={','.join(NORMALIZERS)}"],
        "custom": [
            "normalizer=custom",
            f"normalizer.name={norm_name}",
            f"+normalizer.params.mass={CUSTOM_MASS}",
            f"imports=[{module_name}]",
            # the other attention stages ride along in this single run (no other test trains with them)
            "qk_norm=rmsnorm",
            "softcap=30",
            "position_bias=shaw",
        ],
    }
    commands = {}
    for name, args in argv.items():
        where = f"hydra.{'sweep' if args[0] == '-m' else 'run'}.dir='{folders[name]}'"
        env = plugin_env if name == "custom" else subprocess_env()
        commands[name] = (train_cmd(*args, *common, where), REPO, env)
    before = files_in_default_run_places()
    procs = run_two_at_a_time(commands)
    new = sorted(files_in_default_run_places() - before)
    assert not new, f"a run left files in the repository: {[str(p.relative_to(REPO)) for p in new[:10]]}"
    runs = {name: (procs[name], folders[name]) for name in argv}
    runs["custom_names"] = (module_name, norm_name)
    return runs


@pytest.mark.slow
def test_every_normalizer_trains_and_its_diagnostics_say_what_it_is(training_runs) -> None:
    proc, sweep = training_runs["normalizers"]
    assert proc.returncode == 0, failure(proc)
    assert f"{len(NORMALIZERS)} ok, 0 failed" in proc.stdout
    jobs = jobs_of(sweep, len(NORMALIZERS))
    assert set(jobs) == {(f"normalizer={n}",) for n in NORMALIZERS}
    for name in NORMALIZERS:
        folder = jobs[(f"normalizer={name}",)]
        summary = read_summary(folder)
        assert_ok_and_finite(summary, folder)
        settings = summary["settings"]
        assert settings["normalizer"] == name and settings["position_bias"] is None, summary  # null: no bias
        saved = OmegaConf.load(folder / "config.yaml")
        assert saved.normalizer.name == name
        assert OmegaConf.to_container(saved.normalizer.params) == OmegaConf.to_container(
            OmegaConf.load(REPO / "conf" / "normalizer" / f"{name}.yaml").params
        )
        masses, supports = per_head(folder, "row_mass"), per_head(folder, "support")
        mass, support = summary["metrics"]["attn/row_mass"], summary["metrics"]["attn/support"]
        assert all(0 < m for m in masses), (name, masses)
        if name in SUM_TO_ONE:
            assert all(abs(m - 1) <= 1e-5 for m in masses), (name, masses)
        if name in BELOW_ONE:
            assert all(m < 1 for m in masses), (name, masses)
            assert mass < 1 - 1e-4, (name, mass)
        if name in DENSE:
            assert all(s == 1.0 for s in supports), (name, supports)
        if name in SPARSE:
            assert all(0 < s <= 1 for s in supports), (name, supports)
            assert support < 1, (name, support)  # exact zeros on this probe batch
        assert_negative_mass(summary, folder, differential=False)


@pytest.mark.slow
def test_every_preset_trains_with_and_without_a_position_bias(training_runs) -> None:
    """variant=rope|cosine|diff (and additive) × position_bias=none|alibi: a position bias on any score."""
    proc, sweep = training_runs["presets"]
    assert proc.returncode == 0, failure(proc)
    jobs = jobs_of(sweep, len(PRESETS) * len(BIASES))
    assert set(jobs) == {(f"variant={v}", f"position_bias={b}") for v in PRESETS for b in BIASES}
    expected = {  # summary: (variant, pos_encoding, differential)
        "rope": ("scaled_dot", "rope", False),
        "cosine": ("cosine", "sinusoidal", False),
        "diff": ("scaled_dot", "sinusoidal", True),
        "additive": ("additive", "sinusoidal", False),
    }
    for (variant_arg, bias_arg), folder in jobs.items():
        preset, bias = variant_arg.split("=")[1], bias_arg.split("=")[1]
        summary = read_summary(folder)
        assert_ok_and_finite(summary, folder)
        settings = summary["settings"]
        assert (summary["variant"], summary["pos_encoding"], settings["differential"]) == expected[preset], summary
        assert settings["position_bias"] == (None if bias == "none" else bias) and settings["normalizer"] == "softmax"
        saved = OmegaConf.load(folder / "config.yaml")
        assert saved.position_bias.name == bias and saved.model.differential is (preset == "diff")
        assert saved.model.pos_encoding == expected[preset][1]
        if preset == "rope":
            assert saved.model.rope == {"base": 10000.0, "fraction": 1.0, "spectrum": "full"}
        if preset == "cosine":
            assert saved.variant.params == {"init_scale": 10.0, "max_scale": 100.0}
        assert_negative_mass(summary, folder, differential=preset == "diff")
        supports = per_head(folder, "support")
        assert all(s == 1.0 for s in supports), (folder.name, supports)  # softmax: dense
        if preset == "diff":  # softmax − λ·softmax: rows sum to 1 − λ
            assert 0 < summary["metrics"]["attn/row_mass"] < 1, summary["metrics"]
        else:
            assert all(abs(m - 1) <= 1e-5 for m in per_head(folder, "row_mass")), folder.name


@pytest.mark.slow
def test_the_issue_multirun_runs_eight_jobs(training_runs) -> None:
    """``python train.py -m normalizer=softmax,sigmoid num_kv_heads=1,4 model.pos_encoding=rope,sinusoidal``."""
    proc, sweep = training_runs["issue"]
    assert proc.returncode == 0, failure(proc)
    assert "8 ok, 0 failed" in proc.stdout
    jobs = jobs_of(sweep, 8)
    params = {}
    for key, folder in jobs.items():
        choice = dict(o.split("=", 1) for o in key)
        summary = read_summary(folder)
        assert_ok_and_finite(summary, folder)
        assert summary["settings"]["normalizer"] == choice["normalizer"]
        assert summary["settings"]["num_kv_heads"] == int(choice["num_kv_heads"])
        assert summary["pos_encoding"] == choice["model.pos_encoding"]
        saved = OmegaConf.load(folder / "config.yaml")
        assert saved.num_kv_heads == int(choice["num_kv_heads"]) and saved.normalizer.name == choice["normalizer"]
        params[int(choice["num_kv_heads"])] = params.get(int(choice["num_kv_heads"]), set()) | {summary["params"]}
        if choice["normalizer"] == "softmax":
            assert all(abs(m - 1) <= 1e-5 for m in per_head(folder, "row_mass")), folder.name
        assert all(s == 1.0 for s in per_head(folder, "support")), folder.name
    # one key/value head instead of four: W_k and W_v of every layer shrink from d_model × d_model to d_model × d_k
    assert len(params[1]) == len(params[4]) == 1, params
    d_model, d_k, heads, layers = 64, 16, 4, 2
    assert params[4].pop() - params[1].pop() == layers * 2 * (d_model + 1) * d_k * (heads - 1)


@pytest.mark.slow
def test_a_normalizer_of_your_own_through_imports(training_runs) -> None:
    """``normalizer=custom normalizer.name=<name> 'imports=[module]' +normalizer.params.mass=0.5``: the user's
    function runs (row mass 0.5), with qk_norm=rmsnorm, softcap=30 and position_bias=shaw in the same run."""
    proc, run = training_runs["custom"]
    module_name, norm_name = training_runs["custom_names"]
    assert proc.returncode == 0, failure(proc)
    summary = read_summary(run)
    assert_ok_and_finite(summary, run)
    settings = summary["settings"]
    assert settings["normalizer"] == norm_name
    assert (settings["qk_norm"], settings["softcap"], settings["position_bias"]) == ("rmsnorm", 30, "shaw")
    saved = OmegaConf.load(run / "config.yaml")
    assert saved.imports == [module_name]
    assert saved.normalizer == {"name": norm_name, "params": {"mass": CUSTOM_MASS}}
    masses = per_head(run, "row_mass")
    assert all(abs(m - CUSTOM_MASS) <= 1e-5 for m in masses), masses
    assert_negative_mass(summary, run, differential=False)


# ------------------------------------------------------------------------------------ T5 under a causal mask


def t5_directions(*overrides: str) -> list[bool]:
    cfg = compose_cfg("debug=fast", "logger=none", *overrides)
    module = build_module(cfg, validate_config(cfg))
    found = [m.bidirectional for m in module.modules() if isinstance(m, T5Bias)]
    assert len(found) == cfg.num_layers, found
    return found


@pytest.mark.parametrize(
    ("overrides", "bidirectional"),
    [
        (("variant=t5_bias", "mask=causal"), False),  # T5's decoder buckets
        (("variant=t5_bias", "mask=none"), True),
        (("variant=t5_bias", "mask=causal_window"), False),  # every later key is hidden there too
        (("variant=t5_bias", "mask=causal", "variant.params.bidirectional=true"), True),  # as asked
        (("position_bias=t5", "mask=causal"), False),  # the position-bias group follows the same rule
        (("position_bias=t5", "variant=additive"), True),
    ],
    ids=lambda v: "_".join(v) if isinstance(v, tuple) else str(v),
)
def test_t5_buckets_follow_the_mask(hydra_ctx: None, overrides: tuple[str, ...], bidirectional: bool) -> None:
    assert set(t5_directions(*overrides)) == {bidirectional}


# ------------------------------------------------------------------------------------ bad values


BAD_CLI = {
    "num_kv_heads=3": (["num_kv_heads=3"], r"num_kv_heads \(3\) must divide num_heads \(4\)"),
    "normalizer=sofmax": (["normalizer=sofmax"], r"unknown normalizer 'sofmax'; did you mean 'softmax'\?"),
    "rope.fraction=0": (
        ["variant=rope", "model.rope.fraction=0"],
        r"model\.rope\.fraction must be a finite number in \(0, 1\], got 0",
    ),
    "sigmoid.bias=nan": (
        ["normalizer=sigmoid", "normalizer.params.bias=nan"],
        r"normalizer\.params\.bias must be a finite number, got nan",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_CLI))
def test_bad_stage_values_print_one_line_exit_2_and_write_nothing(tmp_path: Path, case: str) -> None:
    """Each BAD_CLI case as ``python train.py logger=none ...`` started in an empty folder with the default run
    folder, run in this process (:func:`helpers.run_cli`: the same ``main``, exit code and output; test_cli.py runs
    bad inputs of each kind as real commands too)."""
    proc = run_cli("logger=none", *BAD_CLI[case][0], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert_one_error_line(proc, BAD_CLI[case][1])
    assert list(tmp_path.iterdir()) == [], sorted(str(p) for p in tmp_path.rglob("*"))


# The same checks in-process (what train.py runs before Hydra composes, then on the composed config): cheap, so
# the rest of the new keys are covered here.
BAD_IN_PROCESS = [
    (["num_kv_heads=0"], r"^num_kv_heads must be an integer >= 1, got 0$"),
    (["num_kv_heads=2.5"], r"^num_kv_heads must be an integer >= 1, got 2\.5$"),
    (["num_kv_heads=8"], r"^num_kv_heads \(8\) must divide num_heads \(4\)"),
    (["softcap=0"], r"^softcap must be a finite number > 0, got 0$"),
    (["softcap=inf"], r"^softcap must be a finite number > 0, got inf$"),
    (["qk_norm=true"], r"^qk_norm must be null, layernorm or rmsnorm, got True$"),
    (["qk_norm=batchnorm"], r"^qk_norm must be null, layernorm or rmsnorm, got 'batchnorm'$"),
    (["softcap=-1"], r"^softcap must be a finite number > 0, got -1$"),
    (["variant=rope", "model.rope.base=1"], r"^model\.rope\.base must be a finite number > 1, got 1$"),
    (["variant=rope", "model.rope.fraction=1.5"], r"^model\.rope\.fraction must be a finite number in \(0, 1\]"),
    (["model.pos_encoding=rotary"], r"^model\.pos_encoding must be one of sinusoidal, learned, rope, none"),
    (["model.differential=yes"], r"^model\.differential must be true or false, got 'yes'$"),
    (["normalizer=sink", "normalizer.params.init=inf"], r"^normalizer\.params\.init must be a finite number"),
    (["normalizer=softpick", "normalizer.params.eps=0"], r"^normalizer\.params\.eps must be a finite number > 0"),
    (["normalizer=sparsemax", "+normalizer.params.alpha=2"], r"normalizer 'sparsemax' does not take .*'alpha'"),
    (["normalizer=custom"], r"^normalizer\.name is not set \(\?\?\?\): normalizer=custom needs normalizer\.name="),
    (["normalizer=custom", "normalizer.name=softmx"], r"^unknown normalizer 'softmx'; did you mean 'softmax'\?"),
    (["position_bias=alibj"], r"^unknown position.bias 'alibj'; did you mean 'alibi'\?"),
    (["position_bias=custom"], r"^position_bias\.name is not set \(\?\?\?\): position_bias=custom needs"),
    (["position_bias=custom", "position_bias.name=alibii"], r"^unknown position bias 'alibii'; did you mean 'alibi'"),
    (["position_bias=shaw", "position_bias.params.clip=-1"], r"^position_bias\.params\.clip must be an integer >= 0"),
    (["position_bias=t5", "position_bias.params.num_buckets=0"], r"^position_bias\.params\.num_buckets must be an"),
    (["variant=cosine", "variant.params.init_scale=0"], r"^variant\.params\.init_scale must be a finite number > 0"),
]


@pytest.mark.parametrize(
    ("overrides", "message"), BAD_IN_PROCESS, ids=lambda v: "_".join(v) if isinstance(v, list) else ""
)
def test_bad_stage_values_are_one_line_config_errors(hydra_ctx: None, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_group_choices(overrides)  # a name with no yaml file is refused before Hydra composes
        cfg = compose_cfg("debug=fast", "logger=none", *overrides)
        import_user_modules(cfg)
        validate_config(cfg)
    text = str(info.value)
    assert "\n" not in text and len(text) < 400, text
    assert re.search(message, text), text
