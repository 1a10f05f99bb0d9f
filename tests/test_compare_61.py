"""Named models and comparisons (issue 61): the forms' named settings as ``variant=`` options, ``compare=<name>``
expanded into one sweep of named models, the precedence of a model's own settings over the comparison's over the
preset's, the one-line refusals, and the model name a run records.

The expected configs are read independently of :mod:`attnlab.training.compare`: a named setting's params are the
form's yaml (``OmegaConf.load``) updated by :attr:`attnlab.forms.Form.settings`, a comparison's shared settings are
read from its file by hand."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from attnlab.forms import form_class, list_forms
from attnlab.training.cli import check_plugins, main
from attnlab.training.compare import (
    comparison_names,
    describe,
    expand_compare,
    load_comparison,
    model_name,
    register_named_models,
    variant_options,
)
from attnlab.training.config import CONF_DIR, ConfigError, check_group_choices

ROOT = Path(__file__).resolve().parents[1]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def _settings() -> list[tuple[str, str, dict]]:
    """Every built-in form's named setting whose form has a conf/variant yaml, read from the registry."""
    rows = []
    for name in list_forms():
        if not (CONF_DIR / "variant" / f"{name}.yaml").is_file():
            continue
        rows += [(f"{name}_{key}", name, dict(p)) for key, p in form_class(name).settings.items() if p]
    return rows


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_named_models()


@pytest.mark.parametrize(("label", "form", "params"), _settings(), ids=[r[0] for r in _settings()])
def test_a_named_setting_is_a_variant(label, form, params):
    """``variant=<form>_<setting>`` composes as the form's yaml with the setting's params, and nothing else
    changes: the rest of the config is the form's own."""
    assert label in variant_options()
    check_group_choices([f"variant={label}"])  # (no "unknown variant")
    named, plain = _compose(f"variant={label}"), _compose(f"variant={form}")
    raw = OmegaConf.load(CONF_DIR / "variant" / f"{form}.yaml")
    expected = {**OmegaConf.to_container(raw.variant.params if "variant" in raw else raw.params), **params}
    assert OmegaConf.to_container(named.variant.params) == expected
    assert named.variant.name == form
    for key in ("model", "mask", "normalizer", "attention"):
        assert OmegaConf.to_container(named[key], resolve=False) == OmegaConf.to_container(plain[key], resolve=False)
    assert named.hydra.runtime.choices.variant == label


def test_the_built_in_settings_are_listed():
    """The bench's and the card's names are all there (``gated_deltanet_beta2``, ``kda_beta2``, ...)."""
    text = describe()
    for label, _, _ in _settings():
        assert label in text
    assert {"gated_deltanet_beta2", "kda_beta2", "deltanet_beta2", "deltaproduct_beta2"} <= set(variant_options())
    for name in comparison_names():
        assert name in text


@pytest.mark.parametrize("name", comparison_names())
def test_every_shipped_comparison_composes(name):
    """Each model of each comparison of conf/compare composes with its variant, the file's shared settings and its
    own; its config says which comparison and model it is."""
    comparison = load_comparison(name)
    raw = OmegaConf.load(CONF_DIR / "compare" / f"{name}.yaml")
    for model, (variant, _own) in comparison.models.items():
        cfg = _compose(f"compare={name}/{model}")
        assert cfg.compare.name == name and cfg.compare.model == model
        assert cfg.hydra.runtime.choices.variant == variant
        assert model_name(cfg, cfg.hydra.runtime.choices.variant) == model
        spec = dict(raw.compare.models[model] or {})
        for key, value in spec.items():  # the model's own settings, as written
            if key != "variant" and "." in key:
                assert OmegaConf.select(cfg, key) == value, (model, key)
        if "model" in raw and "short_conv" in raw.model and "model.short_conv" not in spec:
            assert cfg.model.short_conv == raw.model.short_conv  # the shared setting beat the preset's


def _write(tmp_path: Path, text: str, name: str = "mine") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


PRECEDENCE = """\
# @package _global_
# precedence
compare:
  models:
    k: {variant: kda}                                   # the preset sets model.short_conv=4
    r: {variant: rwkv7, model.short_conv: 3}            # its own beats the shared 2
    s: {variant: scaled_dot, normalizer: softmax1, d_k: 8}
  seeds: [4, 5]
model:
  short_conv: 2
max_steps: 40
"""


def test_own_beats_shared_beats_preset(tmp_path):
    path = _write(tmp_path, PRECEDENCE, "prec")
    expand_compare(["-m", f"compare={path}"])
    k, r, s = (_compose(f"compare=prec/{m}") for m in "krs")
    assert (k.variant.name, k.model.short_conv) == ("kda", 2)  # shared over the preset's 4
    assert (r.variant.name, r.model.short_conv) == ("rwkv7", 3)  # own over shared
    assert (s.variant.name, s.normalizer.name, s.d_k, s.model.short_conv) == ("scaled_dot", "softmax1", 8, 2)
    assert k.max_steps == 40
    fast = _compose("compare=prec/k", "debug=fast")
    assert fast.max_steps != 40  # debug=fast comes after the comparison
    assert _compose("compare=prec/k", "model.short_conv=7").model.short_conv == 7  # the command line wins


def test_the_expansion(tmp_path):
    path = _write(tmp_path, PRECEDENCE, "prec")
    assert expand_compare(["-m", f"compare={path}"]) == ["-m", "compare=prec/k,prec/r,prec/s", "seed=4,5"]
    assert expand_compare(["-m", f"compare={path}", "seed=9"]) == ["-m", "compare=prec/k,prec/r,prec/s", "seed=9"]
    tuned = expand_compare(["-m", f"compare={path}", "hydra/sweeper=tuned"])
    assert not any(a.startswith(("seed=", "hydra.sweeper.seeds")) for a in tuned)  # the tuned sweeper's own seeds
    assert expand_compare(["-m", "compare=prec/r,prec/s"]) == ["-m", "compare=prec/r,prec/s", "seed=4,5"]
    assert expand_compare(["compare=prec/r", "debug=fast"]) == ["compare=prec/r", "debug=fast"]
    assert expand_compare(["variant=kda"]) == ["variant=kda"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compare=nope"], "unknown comparison 'nope'"),
        (["compare=prec"], "has 3 models (k, r, s): run them with -m"),
        (["-m", "compare=prec/x"], "no model x in the comparison prec"),
        (["-m", "compare=prec/k,state_tracking/rwkv7"], "compare= takes one comparison"),
        (["-m", "compare=prec", "hparams_search=optuna"], "an Optuna search would pick among them"),
        (["-m", "compare=prec", "hydra/sweeper=optuna"], "an Optuna search would pick among them"),
        (["-m", "compare=prec", "variant=kda"], "variant= beside compare="),
        (["-m", "compare=prec", "compare=prec"], "compare= is given twice"),
        (["-m", "compare=/no/such/file.yaml"], "no such file"),
    ],
)
def test_refusals_on_the_command_line(tmp_path, args, message):
    expand_compare(["-m", f"compare={_write(tmp_path, PRECEDENCE, 'prec')}"])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        expand_compare(args)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a\n- b\n", "a mapping of settings"),
        ("x: 1\n", "compare.models must list the models"),
        ("compare: {models: {}}\n", "compare.models must list the models"),
        ("compare: {models: {a: {}}, seed: [1]}\n", "has seed; it takes models and seeds"),
        ("compare: {models: {a: {variant: scaled_dot}}, seeds: [1.5]}\n", "seeds must be a list of integers"),
        ("compare: {models: {a: {variant: scaled_dotx}}}\n", "unknown variant 'scaled_dotx'; did you mean"),
        ("compare: {models: {a: {}}}\n", "unknown variant 'a'"),
        ("compare: {models: {'a,b': {variant: dot}}}\n", "is not a model name"),
        ("compare: {models: {a: {variant: dot, normalizer: nope}}}\n", "'nope' is not an option of conf/normalizer"),
        ("compare: {models: {a: {variant: dot, 'model.2x': 1}}}\n", "is not a config key"),
        ("compare: {models: {a: 3}}\n", "must be a mapping of settings"),
        ("compare: {models: {a: {variant: dot}}\n", "is not a readable YAML file"),
    ],
)
def test_a_bad_comparison_file_is_one_line(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        load_comparison(str(path))
    assert "\n" not in str(info.value)


def test_main_exits_2_with_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["-m", "compare=state_trackin", "--dry-run"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "did you mean 'state_tracking'" in err


def test_the_listing_command(capsys):
    from attnlab.training.compare import main as listing

    assert listing([]) == 0
    out = capsys.readouterr().out
    assert "gated_deltanet_beta2" in out and "state_tracking" in out
    assert listing(["state_tracking"]) == 0
    out = capsys.readouterr().out
    assert "shared by every model" in out and "model.short_conv=4" in out
    assert listing(["nope"]) == 2


def test_a_slurm_plan_needs_no_srun(monkeypatch):
    """``--dry-run`` with the SLURM launcher is a plan for a cluster made on a laptop: no ``srun`` needed."""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda _: None)
    if __import__("importlib").util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        pytest.skip("the submitit plugin (the slurm extra) is not installed")
    with pytest.raises(ConfigError, match="needs a SLURM cluster"):
        check_plugins(["hydra/launcher=slurm"])
    check_plugins(["hydra/launcher=slurm"], dry=True)


def test_a_run_records_its_model_name_and_resumes(tmp_path):
    """A comparison's model trains as one run; ``summary.json`` names the model; the run resumes from its folder
    with nothing but the folder (its recorded ``compare=<name>/<model>`` composes again)."""
    path = _write(tmp_path, PRECEDENCE.replace("max_steps: 40", "max_steps: 4\neval_every: 2"), "prec")
    expand_compare(["-m", f"compare={path}"])
    run = tmp_path / "run"
    common = ["logger=none", "diagnostics.enabled=false", "results_table=false", f"hydra.run.dir={run}"]
    main(["compare=prec/s", "task.datamodule.num_train=64", "task.datamodule.num_val=32",
          "task.datamodule.num_test=32", *common])  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "s" and summary["variant"] == "scaled_dot" and summary["status"] == "ok"
    assert "compare=prec/s" in summary["overrides"]
    main(["resume=true", f"hydra.run.dir={run}", "max_steps=6"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["model"] == "s"


def test_model_name_rule():
    cfg = OmegaConf.create({"variant": {"name": "scaled_dot"}})
    assert model_name(cfg, "rope") == "rope"
    assert model_name(cfg, "custom") == "scaled_dot"
    assert model_name(cfg, None) == "scaled_dot"
    assert model_name(OmegaConf.create({"compare": {"model": "m"}, "variant": {"name": "x"}}), "kda") == "m"


@pytest.mark.slow
def test_a_comparison_sweeps_as_one_command(tmp_path):
    """``python train.py -m compare=<file>`` in a subprocess: every model on every seed, each run named."""
    models = "    a: {variant: scaled_dot}\n    b: {variant: gated_deltanet_beta2}\n"
    path = _write(tmp_path, f"# @package _global_\ncompare:\n  models:\n{models}  seeds: [0, 1]\n", "two")
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", f"compare={path}", "debug=fast", "logger=none",
           f"hydra.sweep.dir={sweep}"]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    names = sorted(json.loads(p.read_text())["model"] for p in sweep.glob("*/summary.json"))
    assert names == ["a", "a", "b", "b"]


def test_a_sweep_report_names_the_model_and_the_headline(tmp_path):
    """The sweep's closing table names a comparison's model as the run recorded it (the folder name cannot hold its
    ``/``) and puts the task's headline metric first: accuracy at the longest test length for parity."""
    from attnlab.console import plain_console
    from attnlab.training.multirun import _jobs_table

    path = _write(tmp_path, "# @package _global_\ncompare:\n  models:\n    s: {variant: scaled_dot}\n", "par")
    expand_compare(["-m", f"compare={path}"])
    run = tmp_path / "0_compare=par_s,seed=0"
    main(["compare=par/s", "task=parity", "task.datamodule.seq_len=8", "task.datamodule.test_lengths=[12,16]",
          "task.datamodule.num_train=64", "task.datamodule.num_val=32", "task.datamodule.num_test=32",
          "max_steps=2", "eval_every=2", "logger=none", "diagnostics.enabled=false", "results_table=false",
          f"hydra.run.dir='{run}'"])  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    assert summary["headline_metric"] == "test/acc@16" and summary["model"] == "s"
    console = plain_console()
    with console.capture() as captured:
        console.print(_jobs_table(tmp_path, [{"job": run.name, "status": "ok", "wall_time_s": 1.0}]))
    text = captured.get()
    assert "model=s" in text and "compare=" not in text
    assert "★ test acc@16" in text and f"{100 * summary['metrics']['test/acc@16']:.1f}%" in text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("compare: {models: {a: {variant: scaled_dot, model.shortconv: 4}}}\n", "did you mean 'model.short_conv'"),
        ("compare: {models: {a: {variant: scaled_dot}}}\nlrr: 0.1\n", "the shared settings sets 'lrr'"),
        ("compare: {models: {a: {variant: kda, variant.params.beta: 2}}}\n", "'variant.params.beta'"),
    ],
)
def test_a_key_the_config_lacks_is_refused_not_dropped(tmp_path, text, message):
    """A typo in a comparison file (a model's own key or a shared one) is one line naming it and the closest key;
    the same key is accepted where the model's config has it."""
    path = _write(tmp_path, "# @package _global_\n" + text, "typo")
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        expand_compare(["-m", f"compare={path}"])
    assert "\n" not in str(info.value)


def test_group_content_choices_and_file_models(tmp_path):
    """A mapping under a group's name is its content, a string its choice; a file's model is picked with
    ``<file>.yaml:<model>``; a file may not take a shipped comparison's name."""
    text = (
        "# @package _global_\ncompare:\n  models:\n"
        "    a: {variant: kda, task: {datamodule: {num_train: 64}}, variant.params: {beta_range: 2}}\n"
        "    b: {variant: scaled_dot, position_bias: alibi}\n"
    )
    path = _write(tmp_path, text, "groups")
    assert expand_compare([f"compare={path}:a", "debug=fast"]) == ["compare=groups/a", "debug=fast"]
    a, b = _compose("compare=groups/a"), _compose("compare=groups/b")
    assert (a.task.datamodule.num_train, a.variant.params.beta_range, a.task.name) == (64, 2, "digits")
    assert b.position_bias.name == "alibi"
    clash = _write(tmp_path, text, "state_tracking")
    with pytest.raises(ConfigError, match="is a comparison of conf/compare already"):
        expand_compare(["-m", f"compare={clash}"])


def test_a_tuned_sweeps_table_names_the_model_and_reads_the_headline(tmp_path, capsys):
    """The tuned sweeper's closing table: a comparison's model by its name, and the seeds' mean of the task's
    headline metric (parity's accuracy at its longest test length), not the training length's."""
    from attnlab.training.tuned import _print_plan

    path = _write(tmp_path, "# @package _global_\ncompare:\n  models:\n    s: {variant: scaled_dot}\n", "tun")
    expand_compare(["-m", f"compare={path}"])
    sweep = tmp_path / "sweep"
    main(["compare=tun/s", "task=parity", "task.datamodule.seq_len=8", "task.datamodule.test_lengths=[16]",
          "task.datamodule.num_train=64", "task.datamodule.num_val=32", "task.datamodule.num_test=32",
          "max_steps=2", "eval_every=2", "logger=none", "diagnostics.enabled=false", "results_table=false",
          f"hydra.run.dir={sweep / 'seeds' / '0_s'}"])  # fmt: skip
    metrics = json.loads((sweep / "seeds" / "0_s" / "summary.json").read_text())["metrics"]
    plan = {"metric": "val/acc_best", "tune_seed": 0, "configurations": [
        {"label": "compare=tun/s", "best": {"lr": 0.003}, "tune": [{"point": {"lr": 0.003}, "value": 0.5}],
         "seeds": [{"job": "seeds/0_s"}]}]}  # fmt: skip
    capsys.readouterr()
    _print_plan(plan, sweep)
    out = capsys.readouterr().out
    assert "model=s" in out and "★ test acc@16 (seeds)" in out
    assert f"{100 * metrics['test/acc@16']:.1f}" in out
