"""Whole-config validation: :func:`validate_config` checks a composed config (after the user's ``imports`` have
run) before a run folder is touched, and raises :class:`~attnlab.training.config.base.ConfigError`, one line naming
the key, its value and what is allowed; ``train.py`` prints it as ``error: ...`` and exits with code 2, having
written nothing.

The checks, one ``_check_*`` per part of the config: unset (``???``) and unresolvable keys first
(:func:`check_resolves`), then sizes and numbers, the model, diagnostics, logger and Lightning trainer settings, each
layer's attention (built on the meta device; a failing build is checked stage by stage so that the line names the
key), the forced backends on the device and precision the run trains with, the task, a causal task's masks, and
the budgets and memory (:mod:`~attnlab.training.config.budgets`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from attnlab.checks import check_choice, check_int, check_number, default_d_k
from attnlab.registry import unknown_name_message
from attnlab.runs import attention_sources
from attnlab.training.config.base import (
    CONF_DIR,
    CUSTOM_GROUPS,
    MAX_STEPS,
    ConfigError,
    _check,
    _flag,
    _on_meta,
    _prefixed,
    plain,
)
from attnlab.training.config.budgets import _check_budgets, _check_memory, resolve_max_tokens
from attnlab.training.config.compose import (
    _check_short_conv,
    _field_error,
    _layer_key,
    attention_configs,
    base_attention,
)

__all__ = [
    "MAX_THREADS_PER_CORE",
    "TRAINER_KEYS",
    "TRAINER_PRECISIONS",
    "check_resolves",
    "planned_elsewhere",
    "validate_config",
]


MAX_THREADS_PER_CORE = 4  # more torch threads than this per core only slow a run (and a million crash torch)
TRAINER_PRECISIONS = ("32-true", "32", "64-true", "64", "16-mixed", "16", "bf16-mixed", "bf16", "16-true", "bf16-true")


def validate_config(cfg: DictConfig) -> Any:
    """Check the whole config (after :func:`~attnlab.training.config.compose.import_user_modules`): sizes,
    numbers, names and parameters of the variant, mask, task and trainer, and whether the task's sequences fit in
    memory. Writes nothing.

    Returns the task's datamodule, built but not set up (its data is generated later).
    """
    check_resolves(cfg)  # (an unset ??? key first)
    for key in ("d_model", "num_heads", "num_layers", "batch_size", "eval_every"):
        _check(check_int, key, cfg.get(key), minimum=1)
    _check(check_int, "max_steps", cfg.get("max_steps"), minimum=1, maximum=MAX_STEPS)
    _check(default_d_k, cfg.d_model, cfg.num_heads, cfg.d_k)
    _check(check_number, "lr", cfg.lr, low=0.0)
    _check(check_int, "seed", cfg.get("seed"), minimum=0, maximum=2**32 - 1)
    _check_budgets(cfg)
    if cfg.get("max_tokens") is None and cfg.max_steps % cfg.eval_every:
        raise ConfigError(
            f"max_steps ({cfg.max_steps}) must be a multiple of eval_every ({cfg.eval_every}), so that the run "
            "validates, and saves the checkpoint a resume continues from, at its last step"
        )
    if cfg.trainer.get("max_steps", cfg.max_steps) != cfg.max_steps:
        raise ConfigError(f"trainer.max_steps ({cfg.trainer.max_steps}) follows max_steps: set max_steps instead")
    _check_threads(cfg.get("threads", "auto"))
    for key in (
        "compile",
        "resume",
        "overwrite",
        "results_table",
        "smoke",
        "diagnostics.enabled",
        "diagnostics.heatmaps",
        "diagnostics.heads",
    ):
        _flag(cfg, key)
    if OmegaConf.select(cfg, "diagnostics.importance") not in (True, False, "auto"):
        raise ConfigError(
            f"diagnostics.importance must be true, false or auto (on in a single run, off in sweeps and smoke runs), "
            f"got {OmegaConf.select(cfg, 'diagnostics.importance')!r}"
        )
    if cfg.get("ckpt_path") is not None and not isinstance(cfg.ckpt_path, str):
        raise ConfigError(f"ckpt_path must be a path, 'last' or null, got {cfg.ckpt_path!r}")
    _check_model(cfg.model)
    _check_diagnostics(cfg)
    _check_logger(cfg.logger)
    _check_trainer(cfg.trainer, cfg.eval_every)
    configs = attention_configs(cfg)
    layers = _on_meta(lambda: _check_attention(cfg, configs))
    _check_backends(cfg, layers)
    datamodule = _check_task(cfg)
    resolve_max_tokens(cfg, datamodule)
    _check_causal(cfg, datamodule, configs)
    _check_memory(cfg, datamodule, layers)
    return datamodule


_ELSEWHERE: contextvars.ContextVar[bool] = contextvars.ContextVar("attnlab_planned_elsewhere", default=False)


@contextlib.contextmanager
def planned_elsewhere() -> Iterator[None]:
    """For ``--dry-run`` only (:mod:`attnlab.training.plan`): validate the configs of jobs that will run on another
    machine (a GPU trainer planned where torch sees no CUDA; a SLURM launcher's jobs), so that their plan can be
    printed from a laptop. Inside the block a GPU trainer is not refused for want of CUDA here (its forced backends
    are checked as on CUDA), and ``threads`` is not bounded by this machine's cores. A real run never enters it:
    its refusals stay."""
    token = _ELSEWHERE.set(True)
    try:
        yield
    finally:
        _ELSEWHERE.reset(token)


def _check_threads(threads: Any) -> None:
    """``threads``: ``auto`` (:func:`attnlab.cores.auto_threads`) or an integer from 1 to
    :data:`MAX_THREADS_PER_CORE` per core this process may use (affinity and cgroup quota,
    :func:`attnlab.cores.available_cores`); planned for another machine (:func:`planned_elsewhere`), any integer
    >= 1."""
    from attnlab.cores import available_cores

    if threads in (None, "auto"):
        return
    most = None if _ELSEWHERE.get() else MAX_THREADS_PER_CORE * available_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1 or (most and threads > most):
        allowed = f"from 1 to {most} (4 per core here)" if most else ">= 1"
        raise ConfigError(f"threads must be auto or an integer {allowed}, got {threads!r}")


def _missing_keys(cfg: DictConfig) -> list[str]:
    """The keys whose value is ``???``, sorted, found without resolving any ``${...}`` (``OmegaConf.missing_keys``
    resolves them, and an interpolation of a missing value raises instead)."""
    found: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{path}[{index}]")
        elif node == "???":
            found.append(path)

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return sorted(found)


def check_resolves(cfg: DictConfig) -> None:
    """No key is unset (``???``: ``variant=custom`` without ``variant.name``), checked first, before anything is
    resolved (the attention node interpolates ``variant.name``, ``normalizer.name`` and ``position_bias.name``),
    and every ``${...}`` of the config resolves: one line naming the key (``lr=${undefined_key}``), not Hydra's
    traceback."""
    from omegaconf.errors import OmegaConfBaseException

    missing = _missing_keys(cfg)
    if missing:
        group = missing[0].removesuffix(".name")
        hint = (
            f"{group}=custom needs {group}.name=<your registered {CUSTOM_GROUPS[group]}> and imports=[module]"
            if group in CUSTOM_GROUPS
            else f"set it with {missing[0]}=..."
        )
        raise ConfigError(f"{missing[0]} is not set (???): {hint}")

    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # (OmegaConf adds full_key lines)
        raise ConfigError(f"{key}: {message}" if key else message) from None


def _check_causal(cfg: DictConfig, datamodule: Any, configs: list[Any]) -> None:
    """A task whose labels are later input tokens (``requires_causal``) refuses a mask, in any layer, that shows a
    later key."""
    if not getattr(datamodule, "requires_causal", False):
        return
    import torch

    from attnlab.config import _mask_text
    from attnlab.masks import build_mask

    for index, config in enumerate(configs):
        mask = build_mask("none" if config.mask is None else config.mask)
        for length in sorted({datamodule.seq_len, datamodule.max_len}):
            allowed = mask.materialize(length, length, tokens=torch.ones(1, length, dtype=torch.long))[0, 0]
            if torch.triu(allowed, diagonal=1).any():
                where = _layer_key(cfg, index).rstrip(".")
                shown = f"mask={cfg.mask.name}" if not where else f"{where} (mask {_mask_text(config.mask)})"
                raise ConfigError(
                    f"{shown} lets a position attend to later tokens, but task={cfg.task.name} is a causal language "
                    "model (the label at position t is the token at t+1, which it would read): use mask=causal or "
                    "mask=causal_window"
                )


def _check_model(model: DictConfig) -> None:
    from attnlab.encoder import POSITIONAL_ENCODINGS, canon_points

    for key in ("d_v", "d_ff"):
        if model.get(key) is not None:
            _check(check_int, f"model.{key}", model[key], minimum=1)
    _check(check_int, "model.warmup_steps", model.warmup_steps, minimum=0)
    _check(check_number, "model.dropout", model.dropout, 0.0, 1.0, high_open=True)
    _check(check_number, "model.weight_decay", model.weight_decay, low=0.0)
    _check(check_choice, "model.pos_encoding", model.pos_encoding, POSITIONAL_ENCODINGS)
    for key in ("norm_first", "differential"):
        _flag(model, key, f"model.{key}")
    _check_short_conv("model.short_conv", model.get("short_conv"))
    _check(canon_points, model.get("canon"), "model.canon")
    _check(check_int, "model.canon_width", model.get("canon_width", 4), minimum=1)
    betas = plain(model.betas)
    if not isinstance(betas, list) or len(betas) != 2:
        raise ConfigError(f"model.betas must be two numbers in [0, 1), got {betas!r}")
    for beta in betas:
        _check(check_number, "model.betas", beta, 0.0, 1.0, high_open=True)


@functools.cache
def _diagnostics_keys() -> tuple[str, ...]:
    """The keys of the ``diagnostics`` node of conf/config.yaml: the only ones a run reads."""
    node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml")).get("diagnostics") or {}
    return tuple(str(key) for key in node)


MAX_RANDOM_ORDERS = 1000
"""The most random pruning orders (``diagnostics.random_orders``) a run measures."""
MAX_PRUNE_POINTS = 100_000
"""The most test points (passes over the test set) the random pruning orders may cost in all."""


def _check_diagnostics(cfg: DictConfig) -> None:
    import difflib

    d = cfg.diagnostics
    known = _diagnostics_keys()
    for key in map(str, d):
        if known and key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
            hint = f"did you mean diagnostics.{close[0]}? " if close else ""
            raise ConfigError(f"diagnostics.{key} is not a diagnostics setting ({hint}allowed: {', '.join(known)})")
    _check(check_int, "diagnostics.every_n_steps", d.every_n_steps, minimum=0)
    _check(check_int, "diagnostics.probe_size", d.probe_size, minimum=1)
    _check(check_number, "diagnostics.threshold", d.threshold, 0.0, 1.0, low_open=True, high_open=True)
    _check(check_int, "diagnostics.window", d.window, minimum=0)
    _check(check_int, "diagnostics.near_keys", d.near_keys, minimum=1)
    orders = _check(check_int, "diagnostics.random_orders", _integral(d.random_orders), minimum=0)
    if type(d.random_orders) is not int:  # (2.0: recorded as 2)
        OmegaConf.update(cfg, "diagnostics.random_orders", orders)
    if d.enabled is True and d.get("importance") is not False:  # (true, or auto: on in a single run)
        heads = cfg.num_layers * cfg.num_heads
        most = min(MAX_RANDOM_ORDERS, MAX_PRUNE_POINTS // heads)
        if orders > most:
            raise ConfigError(
                f"diagnostics.random_orders must be an integer from 0 to {most:,} (each random order costs the "
                f"pruning step {heads:,} more passes over the test set, one per head removed; at most "
                f"{MAX_RANDOM_ORDERS:,} orders and {MAX_PRUNE_POINTS:,} passes in all), got {orders:,}"
            )


def _integral(value: Any) -> Any:
    """A float that is a whole number (``1e9``) as an int, so that its range is judged; anything else unchanged."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _check_logger(logger: DictConfig) -> None:
    _check(check_choice, "logger.name", logger.name, ("wandb", "csv", "none"))
    if logger.name == "wandb":
        _check(check_choice, "logger.mode", logger.mode, ("offline", "online", "disabled"))
        if logger.mode == "online" and not _wandb_credentials():
            raise ConfigError(
                "logger.mode=online needs W&B credentials: run `wandb login` (or set WANDB_API_KEY), or keep "
                "the default offline mode and `wandb sync` later"
            )


def _wandb_credentials() -> bool:
    """Whether W&B has a stored key (no network, no prompt; W&B would warn under WANDB_MODE=offline, which the
    config's ``logger.mode=online`` overrides anyway)."""
    import wandb

    mode = os.environ.pop("WANDB_MODE", None)
    try:
        return bool(wandb.login(prompt=False))
    finally:
        if mode is not None:
            os.environ["WANDB_MODE"] = mode


def _batches(name: str, value: Any, zero: bool = False) -> None:
    """Lightning's ``limit_*_batches`` / ``overfit_batches``: a fraction in (0, 1] or a count >= 1 (0 allowed with
    ``zero``)."""
    if isinstance(value, float):
        check_number(name, value, 0.0, 1.0, low_open=not zero)
    else:
        check_int(name, value, minimum=0 if zero else 1)


def _flag_or_warn(name: str, value: Any) -> None:
    if not isinstance(value, bool) and value != "warn":
        raise ValueError(f"{name} must be true, false or warn, got {value!r}")


def _optional_number(name: str, value: Any) -> None:
    if value is not None:
        check_number(name, value, low=0.0)


def _optional_choice(choices: tuple[Any, ...]) -> Any:
    return lambda name, value: check_choice(name, value, choices)


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


# The Lightning Trainer arguments a user may set (``trainer.<key>=``), each with its check; attnlab sets the others
# itself (callbacks, loggers, plugins, default_root_dir, checkpointing) or derives them (max_steps, max_epochs,
# val_check_interval, check_val_every_n_epoch: the run counts optimizer steps and validates every eval_every).
TRAINER_KEYS: dict[str, Any] = {
    "_target_": _optional_choice(("lightning.Trainer", "lightning.pytorch.Trainer")),
    "accelerator": _optional_choice(("auto", "cpu", "gpu", "cuda", "mps", "tpu")),
    "devices": None,  # checked below (auto, a count, or a list of device indices)
    "strategy": lambda name, value: isinstance(value, str) or _bool(name, value),
    "num_nodes": lambda name, value: check_int(name, value, minimum=1),
    "precision": lambda name, value: check_choice(name, str(value), TRAINER_PRECISIONS),
    "max_steps": None,  # follows max_steps (checked with it)
    "max_epochs": _optional_choice((-1, None)),
    "val_check_interval": None,  # follows eval_every (checked with it)
    "check_val_every_n_epoch": _optional_choice((None,)),
    "log_every_n_steps": lambda name, value: check_int(name, value, minimum=1),
    "num_sanity_val_steps": lambda name, value: check_int(name, value, minimum=-1),
    "gradient_clip_val": _optional_number,
    "gradient_clip_algorithm": _optional_choice(("norm", "value", None)),
    "accumulate_grad_batches": lambda name, value: check_int(name, value, minimum=1),
    "deterministic": _flag_or_warn,
    "benchmark": lambda name, value: value is None or _bool(name, value),
    "enable_model_summary": _bool,
    "enable_progress_bar": _bool,
    "detect_anomaly": _bool,
    "sync_batchnorm": _bool,
    "inference_mode": _bool,
    "limit_train_batches": _batches,
    "limit_val_batches": _batches,
    "limit_test_batches": _batches,
    "overfit_batches": lambda name, value: _batches(name, value, zero=True),
    "profiler": _optional_choice((None, "simple", "advanced", "pytorch")),
}
_TRAINER_FOLLOWS = ("max_steps", "max_epochs", "val_check_interval", "check_val_every_n_epoch")
_TRAINER_DERIVED = {
    "max_epochs": "attnlab trains for max_steps optimizer steps (trainer.max_epochs is -1): set max_steps instead",
    "check_val_every_n_epoch": "attnlab validates every eval_every steps: set eval_every instead",
}


def _check_trainer(trainer: DictConfig, eval_every: int) -> None:
    """Every key of ``trainer`` is one a user may set (:data:`TRAINER_KEYS`) with a value Lightning takes; the
    keys that attnlab derives from its own settings follow them. One line naming the key."""
    import difflib

    import torch

    settable = [k for k in TRAINER_KEYS if not k.startswith("_") and k not in _TRAINER_FOLLOWS]
    for key in trainer:
        if key not in TRAINER_KEYS:
            close = difflib.get_close_matches(str(key), settable, n=1)
            hint = f"did you mean trainer.{close[0]}? " if close else ""
            listed = ", ".join(settable)
            raise ConfigError(f"trainer.{key} is not a trainer setting attnlab takes ({hint}allowed: {listed})")
        check = TRAINER_KEYS[key]
        if check is not None:
            try:
                check(f"trainer.{key}", trainer[key])
            except ValueError as exc:
                raise ConfigError(f"{exc}; {_TRAINER_DERIVED[key]}" if key in _TRAINER_DERIVED else str(exc)) from None
    if trainer.get("val_check_interval", eval_every) != eval_every:
        raise ConfigError(
            f"trainer.val_check_interval ({trainer.val_check_interval}) follows eval_every ({eval_every}): set "
            "eval_every instead"
        )
    accelerator = str(trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available() and not _ELSEWHERE.get():
        raise ConfigError(
            f"trainer.accelerator={accelerator} but torch sees no CUDA GPU on this machine; "
            "use trainer=auto (the GPU when there is one, else the CPU) or trainer=cpu"
        )
    devices = trainer.get("devices", "auto")
    if OmegaConf.is_list(devices):
        for device in devices:
            _check(check_int, "trainer.devices", device, minimum=0)
    elif devices not in ("auto", -1):
        _check(check_int, "trainer.devices", devices, minimum=1)


def _check_attention(cfg: DictConfig, configs: list[Any]) -> list[Any]:
    """Build each distinct layer's attention once (on the meta device, see :func:`_on_meta`). Where a build fails,
    the stages are checked one by one (:func:`_check_stages`: the configured attention's, then the layer's own) so
    that the one line names the config key; else the build's own message is given. Returns the built layers."""
    from attnlab.attention import MultiHeadAttention

    base = base_attention(cfg)
    built: dict[int, Any] = {}
    layers = []
    for index, config in enumerate(configs):
        first = next(i for i, c in enumerate(configs) if c == config)
        if first not in built:
            try:
                built[first] = MultiHeadAttention(cfg.d_model, cfg.num_heads, config=config, layer=index + 1)
            except (TypeError, ValueError) as exc:
                where = "" if config == base else _layer_key(cfg, index)
                _check_stages(cfg, base, "")
                if where:
                    _check_stages(cfg, config, where)
                raise _field_error(exc, f"{where.rstrip('.')}: " if where else "") from None
        layers.append(built[first])
    return layers


def _check_stages(cfg: DictConfig, config: Any, where: str) -> None:
    """Each stage of one layer's ``config`` by name and parameters, the message naming the config key (the base
    config's keys: ``variant.params.clip``; a layer's own: ``model.layer_kinds.L.mask``)."""
    from attnlab.config import build_preset
    from attnlab.forms import LayerOptionError, LayerSizes, build_form, form_for, list_forms
    from attnlab.masks import build_mask, list_masks
    from attnlab.normalizers import build_normalizer, list_normalizers
    from attnlab.position_bias import build_position_bias, list_position_biases
    from attnlab.positions import RotaryEmbedding
    from attnlab.scores import build_score, is_preset, list_presets, list_scores

    src = attention_sources() if not where else {f: f"{where}{f}" for f in attention_sources()}
    d_k = default_d_k(cfg.d_model, cfg.num_heads, config.d_k)
    heads = cfg.num_heads * (2 if config.differential else 1)  # differential: two maps per head
    sizes = {"d_k": d_k, "num_heads": heads, "d_v": config.d_v or d_k}

    name, params = config.score, config.score_params
    forms = [n for n in list_forms() if n not in ("softmax", "linear")]  # the forms a variant names
    variants = sorted({*list_scores(), *list_presets(), *forms})
    if name not in variants:
        message = unknown_name_message("variant", name, variants)
        raise ConfigError(f"{message}. A score of your own: variant=custom variant.name=<name> 'imports=[module]'")
    prefix = src["score_params"] + "."
    try:
        if name in forms and form_for(config) == name:  # a form's parameters: built where it costs nothing
            with torch.device("meta"):
                kv = config.num_kv_heads or cfg.num_heads
                build_form(name, LayerSizes(cfg.d_model, cfg.num_heads, kv, d_k, sizes["d_v"]), config)
        else:
            if is_preset(name):
                changes = build_preset(name, **params)
                name, params = changes.get("score", "scaled_dot"), changes.get("score_params", {})
            build_score(name, **sizes, **params)
    except LayerOptionError as exc:  # a layer option the form does not take: not one of its parameters
        raise ConfigError(" ".join(str(exc).split())) from None
    except (TypeError, ValueError) as exc:
        raise _prefixed(prefix, exc, params) from None

    spec = config.mask
    for sub in _mask_specs(spec):
        mask_name = sub.get("name") if isinstance(sub, dict) else sub
        if sub is not None and not hasattr(sub, "mask_mod") and mask_name not in list_masks():
            message = unknown_name_message("mask", mask_name, list_masks())
            raise ConfigError(f"{message}. A mask of your own: mask=custom mask.name=<name> 'imports=[module]'")
    if spec is not None:
        try:
            build_mask(spec)
        except (TypeError, ValueError) as exc:
            raise _prefixed(src["mask"] + ".", exc, spec if isinstance(spec, dict) else {}) from None

    if config.rope is not None:
        try:
            RotaryEmbedding(d_k, **config.rope)
        except (TypeError, ValueError) as exc:
            base = src["rope"].rpartition(".")[0] + "." if not where else where
            raise _prefixed(base, exc, [f"rope.{k}" for k in config.rope]) from None

    stages = (
        ("normalizer", list_normalizers, lambda n, p: build_normalizer(n, num_heads=heads, **p)),
        ("position_bias", list_position_biases, lambda n, p: build_position_bias(n, **sizes, **p)),
    )
    for group, names, build in stages:
        stage_name = getattr(config, group) or "none"
        stage_params = getattr(config, f"{group}_params")
        if stage_name not in names():
            message = unknown_name_message(group.replace("_", " "), stage_name, names())
            raise ConfigError(f"{message}. Your own: {group}=custom {group}.name=<name> 'imports=[module]'")
        try:
            build(stage_name, stage_params)
        except (TypeError, ValueError) as exc:
            raise _prefixed(src[f"{group}_params"] + ".", exc, stage_params) from None

    from attnlab.backends import list_backends

    if config.backend != "auto" and config.backend not in list_backends():
        message = unknown_name_message("backend", config.backend, list_backends())
        raise ConfigError(f"{src['backend']}: {message}, or auto")


def _mask_specs(spec: Any) -> Iterable[Any]:
    yield spec
    if isinstance(spec, dict):
        for sub in spec.get("masks") or []:
            yield from _mask_specs(sub)


def _check_task(cfg: DictConfig) -> Any:
    """Build the task's datamodule (not set up) from the class registered under its name: ``_target_`` must name
    that class, and is never imported (a config may come from a folder someone else wrote)."""
    from attnlab.tasks import list_tasks, task_class

    if cfg.task.name not in list_tasks():
        message = unknown_name_message("task", cfg.task.name, list_tasks())
        raise ConfigError(f"{message}. A task of your own: task=custom task.name=<name> 'imports=[module]'")
    params = plain(cfg.task.datamodule)
    target, cls = params.pop("_target_", None), task_class(cfg.task.name)
    if target is not None and str(target).rpartition(".")[2] != cls.__name__:
        raise ConfigError(
            f"task.datamodule._target_={target} is not the class of task={cfg.task.name} "
            f"({cls.__module__}.{cls.__name__})"
        )
    flags = _task_flags(cls)
    for key, value in params.items():
        if key in flags and not isinstance(value, bool):
            raise ConfigError(f"task.datamodule.{key} must be true or false, got {value!r}")
    try:
        datamodule = cls(**params)
    except (TypeError, ValueError) as exc:
        raise _prefixed("task.datamodule.", exc, params) from None
    if datamodule.batch_size > datamodule.num_train:
        raise ConfigError(
            f"batch_size ({datamodule.batch_size}) is larger than the training set ({datamodule.num_train})"
        )
    if cfg.diagnostics.enabled and cfg.diagnostics.probe_size > datamodule.num_val:
        raise ConfigError(
            f"diagnostics.probe_size ({cfg.diagnostics.probe_size}) is larger than the validation set "
            f"({datamodule.num_val})"
        )
    return datamodule


def _task_flags(cls: type) -> set[str]:
    """The parameters of task class ``cls`` that are true or false (annotated ``bool``): the data options'
    (``resample``) and the task's own (``permute``), which the task would otherwise read as any truthy value."""
    import dataclasses
    import inspect

    from attnlab.tasks.base import DataOptions

    flags = {f.name for f in dataclasses.fields(DataOptions) if f.type in (bool, "bool")}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            try:
                parameters = inspect.signature(init).parameters.values()
            except (TypeError, ValueError):
                continue
            flags |= {p.name for p in parameters if p.annotation in (bool, "bool")}
    return flags


def _training_conditions(trainer: DictConfig) -> tuple[str, Any]:
    """(device type, compute dtype) of the training steps the ``trainer`` node will run: CUDA where it asks for a
    GPU (or ``auto``) and torch sees one, the CPU otherwise; the dtype from ``trainer.precision``."""
    import torch

    accelerator = str(trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        device = "cuda"
    elif accelerator in ("gpu", "cuda") and _ELSEWHERE.get():  # (a GPU job planned here: checked as on CUDA)
        device = "cuda"
    elif accelerator == "mps":
        device = "mps"
    else:
        device = "cpu"
    from attnlab.backends import precision_dtype

    return device, precision_dtype(trainer.get("precision", "32-true"))


def _check_backends(cfg: DictConfig, layers: list[Any]) -> None:
    """A backend forced with ``attention.backend`` (or a layer kind's ``backend``) computes each layer's training
    step on the device and precision the run trains with (FlexAttention has no CPU backward), checked here, before
    the run folder exists; ``auto`` always finds one."""
    device, dtype = _training_conditions(cfg.trainer)
    seen: set[int] = set()
    for index, layer in enumerate(layers):
        if id(layer) in seen or layer.config.backend == "auto":
            continue
        seen.add(id(layer))
        try:
            layer.backend_for(device, dtype)
        except RuntimeError as exc:
            where = _layer_key(cfg, index).rstrip(".")
            prefix = f"{where}: " if where and layer.config.backend != base_attention(cfg).backend else ""
            message = " ".join(str(exc).split())
            raise ConfigError(
                f"{prefix}{message} (a training run on {device} in {str(dtype).removeprefix('torch.')}; "
                "attention.backend=auto picks one that can)"
            ) from None
