"""Tests of the Hydra configs in conf/: every option of every group composes and resolves, the variant configs
match the score registry, d_k defaults, and the task data modules instantiate. No training here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

import attnlab
import attnlab.forms
import attnlab.training as T  # registers the ``attnlab_uid`` resolver
from attnlab.tasks import SequenceTask

CONF_DIR: Path = T.CONF_DIR
# variant presets that are a registered score plus a model setting: option -> (score, model key, value)
PIPELINE_PRESETS = {
    "rope": ("scaled_dot", "pos_encoding", "rope"),
    "diff": ("scaled_dot", "differential", True),
    "based": ("linear", "pattern", "TW"),  # Based: taylor linear layers (short convolutions) and window softmax layers
    "forgetting_pro": ("forgetting", "short_conv", 4),  # FoX's Pro block: gate, QK-norm, short convolution
    "stickbreaking": ("scaled_dot", "pos_encoding", "none"),  # scaled_dot + normalizer=stickbreaking, causal
}
RELATIVE_VARIANTS = ("relative_position", "t5_bias", "alibi")
ABSOLUTE_VARIANTS = ("dot", "scaled_dot", "general", "additive")
FAST = "debug=fast"

# extra overrides that some options need to compose (and resolve: the attention node interpolates the stages' names)
NEEDS = {
    ("variant", "custom"): ["variant.name=dot"],
    ("task", "custom"): ["task.name=digits"],
    ("normalizer", "custom"): ["normalizer.name=softmax"],
    ("position_bias", "custom"): ["position_bias.name=alibi"],
}


def group_options() -> list[tuple[str, str]]:
    """(group, option) for every yaml file in every group folder of conf/ (nested groups as ``a/b``)."""
    found = []
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        rel = path.relative_to(CONF_DIR)
        if len(rel.parts) < 2:  # the primary config itself
            continue
        found.append(("/".join(rel.parts[:-1]), path.stem))
    return found


OPTIONS = group_options()
GROUPS = sorted({g for g, _ in OPTIONS})


def options(group: str) -> list[str]:
    return [o for g, o in OPTIONS if g == group]


@pytest.fixture(autouse=True)
def _keep_launch_uid() -> Iterator[None]:
    """Resolving ``${attnlab_uid:}`` stores a launch id in os.environ; do not leak it into other tests (the
    subprocess tests must each draw their own)."""
    before = os.environ.get("ATTNLAB_UID")
    yield
    if before is None:
        os.environ.pop("ATTNLAB_UID", None)
    else:
        os.environ["ATTNLAB_UID"] = before


def compose_option(group: str, option: str, *extra: str) -> DictConfig:
    """Compose with ``group=option`` (or ``+group=option`` when the group is not in any defaults list)."""
    overrides = [*NEEDS.get((group, option), []), *extra]
    try:
        return compose_cfg(f"{group}={option}", *overrides, hydra_cfg=True)
    except ConfigCompositionException as e:
        if "No match in the defaults list" not in str(e):
            raise
        return compose_cfg(f"+{group}={option}", *overrides, hydra_cfg=True)


# values Hydra fills in only when it launches a job (interpolated by hydra.sweep.subdir and the job log file);
# compose() leaves them missing, so set them as the first job of a sweep would have them
LAUNCH_TIME_VALUES = {
    "job": {"num": 0, "id": "0"},
    "runtime": {"output_dir": "${hydra.sweep.dir}/${hydra.sweep.subdir}"},
}


def resolve_all(cfg: DictConfig) -> dict:
    """The whole config, Hydra's node included, fully resolved."""
    with open_dict(cfg):
        for node, values in LAUNCH_TIME_VALUES.items():
            for key, value in values.items():
                if OmegaConf.is_missing(cfg.hydra[node], key):
                    cfg.hydra[node][key] = value
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


def has_interpolation(obj: object) -> bool:
    if isinstance(obj, dict):
        return any(has_interpolation(v) for v in obj.values())
    if isinstance(obj, list):
        return any(has_interpolation(v) for v in obj)
    return isinstance(obj, str) and "${" in obj


# ------------------------------------------------------------------------------------ every option composes


def test_conf_has_the_expected_groups() -> None:
    for group in ("variant", "mask", "task", "model", "trainer", "logger", "debug", "hydra"):
        assert options(group), f"conf/{group}/ has no yaml file"
    assert {"dot", "scaled_dot", "general", "additive", "relative_position", "t5_bias", "alibi", "custom"} <= set(
        options("variant")
    )
    assert {"none", "causal", "sliding_window", "causal_window", "padding"} <= set(options("mask"))
    assert {"digits", "associative_recall", "listops"} <= set(options("task"))
    assert {"auto", "cpu", "gpu", "gpu_bf16"} <= set(options("trainer"))
    assert {"csv", "none"} <= set(options("logger"))
    assert {"fast", "overfit", "limit"} <= set(options("debug"))


def test_default_config_composes_and_resolves(hydra_ctx: None) -> None:
    cfg = compose_cfg(hydra_cfg=True)
    plain = resolve_all(cfg)
    assert not has_interpolation(plain)
    for key in ("d_model", "d_k", "num_heads", "num_layers", "lr", "batch_size", "max_steps", "seed", "eval_every"):
        assert key in plain, key
    for key in ("imports", "optimized_metric", "results_table", "threads"):
        assert key in plain, key
    assert plain["d_k"] is None
    assert plain["imports"] == []
    assert plain["optimized_metric"] == "val/acc_best"
    # the run and sweep folders carry the launch id
    uid = os.environ["ATTNLAB_UID"]
    assert plain["hydra"]["run"]["dir"].endswith("_" + uid)
    assert plain["hydra"]["sweep"]["dir"].endswith("_" + uid)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_resolves(hydra_ctx: None, group: str, option: str) -> None:
    cfg = compose_option(group, option)
    plain = resolve_all(cfg)
    assert not has_interpolation(plain), f"{group}={option} leaves an unresolved interpolation"
    # the parts train.run reads are all there
    for key in ("variant", "mask", "task", "model", "trainer", "logger"):
        assert isinstance(plain[key], dict), f"{group}={option}: no '{key}' node"
    assert isinstance(plain["variant"]["name"], str) and plain["variant"]["name"] != "???"
    assert "name" in plain["mask"]
    assert "name" in plain["logger"]
    assert "_target_" in plain["task"]["datamodule"] or (group, option) == ("task", "custom")
    assert "_target_" in plain["trainer"]
    # a group's yaml actually lands in the config (not in an unexpected package)
    if group == "variant" and option in PIPELINE_PRESETS:
        score, model_key, value = PIPELINE_PRESETS[option]
        assert plain["variant"]["name"] == score and plain["model"][model_key] == value
    elif group == "variant" and option != "custom":
        assert plain["variant"]["name"] == option
    if group in ("normalizer", "position_bias") and option != "custom":
        assert plain[group]["name"] == option
    # the attention node (built into each layer's AttentionConfig) reads the stages' choices
    assert plain["attention"]["score"] == plain["variant"]["name"]
    assert plain["attention"]["normalizer"] == plain["normalizer"]["name"]
    assert plain["attention"]["position_bias"] == plain["position_bias"]["name"]
    if group == "task" and option != "custom":
        assert plain["task"]["name"] == option
    if group == "logger":
        assert plain["logger"]["name"] == option


@pytest.mark.parametrize("option", options("debug"))
def test_debug_options_compose_with_every_task(hydra_ctx: None, option: str) -> None:
    for task in options("task"):
        plain = resolve_all(compose_cfg(f"debug={option}", f"task={task}", hydra_cfg=True))
        assert plain["trainer"]["max_steps"] == plain["max_steps"]
        assert plain["trainer"]["val_check_interval"] == plain["eval_every"]


def test_fast_debug_is_small(hydra_ctx: None) -> None:
    cfg = compose_cfg(FAST)
    assert cfg.max_steps <= 10
    assert cfg.d_model <= 64
    assert cfg.trainer.max_steps == cfg.max_steps
    dm = cfg.task.datamodule
    assert dm.num_train <= 128 and dm.num_val <= 64 and dm.num_test <= 64
    assert dm.batch_size == cfg.batch_size <= dm.num_train


@pytest.mark.parametrize("option", [o for o in options("trainer") if not o.startswith("gpu")])
def test_cpu_trainers_instantiate(hydra_ctx: None, option: str, tmp_path: Path) -> None:
    cfg = compose_cfg(f"trainer={option}", FAST)
    trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    assert trainer.max_steps == cfg.max_steps
    if option == "cpu" or not torch.cuda.is_available():
        assert trainer.strategy.root_device.type == "cpu"


@pytest.mark.parametrize("option", [o for o in options("trainer") if o.startswith("gpu")])
def test_gpu_trainers_ask_for_a_gpu(hydra_ctx: None, option: str) -> None:
    cfg = compose_cfg(f"trainer={option}")
    assert cfg.trainer.accelerator in ("gpu", "cuda")
    if option == "gpu_bf16":
        assert "bf16" in str(cfg.trainer.precision)


# ------------------------------------------------------------------------------------ variants and the registry


@pytest.mark.parametrize("name", attnlab.list_scores())
def test_every_registered_score_has_a_variant_config(hydra_ctx: None, name: str) -> None:
    assert (CONF_DIR / "variant" / f"{name}.yaml").is_file(), f"no conf/variant/{name}.yaml"
    cfg = compose_cfg(f"variant={name}")
    assert cfg.variant.name == name
    params = OmegaConf.to_container(cfg.variant.get("params") or OmegaConf.create({}), resolve=True)
    assert isinstance(params, dict)
    # the params in the yaml are accepted by the score
    attnlab.build_score(name, d_k=8, num_heads=2, **{k: v for k, v in params.items()})
    if name in RELATIVE_VARIANTS:
        assert cfg.model.pos_encoding == "none", f"{name} should switch off the absolute positional encoding"
    elif name in ABSOLUTE_VARIANTS:
        assert cfg.model.pos_encoding != "none", f"{name} has no position information without a positional encoding"


def test_every_variant_config_names_a_registered_score(hydra_ctx: None) -> None:
    for option in options("variant"):
        if option == "custom":
            continue
        known = [*attnlab.list_scores(), *attnlab.forms.list_forms()]
        if option in PIPELINE_PRESETS:  # a score (or form) plus a model setting
            assert compose_cfg(f"variant={option}").variant.name in known
            continue
        assert option in known, f"conf/variant/{option}.yaml has no registered score or form"


@pytest.mark.parametrize(
    ("group", "names", "build"),
    [
        ("normalizer", attnlab.list_normalizers, lambda n, p: attnlab.build_normalizer(n, num_heads=2, **p)),
        (
            "position_bias",
            attnlab.list_position_biases,
            lambda n, p: attnlab.build_position_bias(n, d_k=8, num_heads=2, **p),
        ),
    ],
)
def test_every_registered_normalizer_and_position_bias_has_a_config(hydra_ctx: None, group, names, build) -> None:
    for name in names():
        assert (CONF_DIR / group / f"{name}.yaml").is_file(), f"no conf/{group}/{name}.yaml"
        cfg = compose_cfg(f"{group}={name}")
        assert cfg[group].name == name
        params = OmegaConf.to_container(cfg[group].params, resolve=True)
        build(name, params)  # the params in the yaml are accepted
    assert compose_cfg().normalizer.name == "softmax" and compose_cfg().position_bias.name == "none"


def test_custom_variant_needs_a_name(hydra_ctx: None) -> None:
    cfg = compose_cfg("variant=custom")
    assert OmegaConf.is_missing(cfg.variant, "name")
    cfg = compose_cfg("variant=custom", "variant.name=dot")
    assert cfg.variant.name == "dot"


def test_pipeline_presets_set_their_model_key_and_the_command_line_wins(hydra_ctx: None) -> None:
    assert compose_cfg("variant=rope").model.pos_encoding == "rope"
    assert compose_cfg("variant=rope", "model.pos_encoding=sinusoidal").model.pos_encoding == "sinusoidal"
    assert compose_cfg("variant=diff").model.differential is True
    assert compose_cfg("variant=scaled_dot").model.differential is False


def test_relative_variant_wins_over_model_default_but_not_over_command_line(hydra_ctx: None) -> None:
    assert compose_cfg("variant=alibi").model.pos_encoding == "none"
    assert compose_cfg("variant=alibi", "model.pos_encoding=learned").model.pos_encoding == "learned"
    assert compose_cfg("variant=scaled_dot").model.pos_encoding == "sinusoidal"


# ------------------------------------------------------------------------------------ d_k


def test_d_k_defaults_to_d_model_over_num_heads(hydra_ctx: None) -> None:
    cfg = compose_cfg()
    assert cfg.d_k is None
    assert T.resolve_d_k(cfg) == cfg.d_model // cfg.num_heads
    assert T.resolve_d_k(compose_cfg("d_model=64", "num_heads=4")) == 16
    assert T.resolve_d_k(compose_cfg("d_model=48", "num_heads=1")) == 48
    assert T.resolve_d_k(compose_cfg("d_model=32", "num_heads=8")) == 4


def test_explicit_d_k_is_honoured(hydra_ctx: None) -> None:
    cfg = compose_cfg("d_k=512", "num_heads=1")
    assert T.resolve_d_k(cfg) == 512
    assert T.resolve_d_k(compose_cfg("d_k=8", "num_heads=4", "d_model=64")) == 8
    # d_k need not divide d_model
    assert T.resolve_d_k(compose_cfg("d_k=7", "num_heads=3", "d_model=32")) == 7


def test_d_k_null_with_indivisible_heads_is_an_error(hydra_ctx: None) -> None:
    with pytest.raises(ValueError, match="divisible"):
        T.resolve_d_k(compose_cfg("d_model=30", "num_heads=4"))


def test_explicit_d_k_reaches_the_module(hydra_ctx: None) -> None:
    cfg = compose_cfg(FAST, "d_k=512", "num_heads=1", "d_model=16", "num_layers=1")
    dm = instantiate(cfg.task.datamodule)
    module = T.build_module(cfg, dm)
    assert module.hparams.d_k == 512
    n_qk = sum(p.numel() for n, p in module.named_parameters() if "q_proj.weight" in n)
    assert n_qk == 16 * 512  # one layer, one head: W_q is (512, 16)


# ------------------------------------------------------------------------------------ tasks


@pytest.mark.parametrize("task", attnlab.list_tasks())
def test_task_datamodule_instantiates_with_fast_sizes(hydra_ctx: None, task: str) -> None:
    cfg = compose_cfg(f"task={task}", FAST)
    dm = instantiate(cfg.task.datamodule)
    assert isinstance(dm, SequenceTask)
    assert dm.name == cfg.task.name == task
    sizes = cfg.task.datamodule
    assert (dm.num_train, dm.num_val, dm.num_test) == (sizes.num_train, sizes.num_val, sizes.num_test)
    assert dm.batch_size == cfg.batch_size and dm.seed == cfg.seed
    tokens, labels = next(iter(dm.train_dataloader()))
    assert tokens.shape == (cfg.batch_size, dm.seq_len)
    assert tokens.dtype == torch.long and 0 <= int(tokens.min()) and int(tokens.max()) < dm.vocab_size
    assert labels.shape == ((cfg.batch_size, dm.seq_len) if dm.per_token else (cfg.batch_size,))
    for split, n in (("train", sizes.num_train), ("val", sizes.num_val), ("test", sizes.num_test)):
        assert dm.tensors(split)[0].shape[0] == n
        assert dm.tensors(split)[0].shape[1] <= dm.max_len
