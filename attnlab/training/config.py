"""The config: where it lives, how a whole config is checked before a run folder is touched, and how it maps
to the module, the threads and a resume.

:func:`check_group_choices` runs on the command line's overrides before Hydra composes anything (an unknown
``variant=adittive`` gets "did you mean 'additive'?") and :func:`check_override_text` (text Hydra's grammar cannot
read: an unquoted ``task.name=é``), :func:`validate_config` on the composed config after the user's ``imports`` have
run. All raise :class:`ConfigError`, whose message is one line naming the key, its value
and what is allowed. ``train.py`` prints it as ``error: ...`` and exits with code 2, having written nothing.

Budgets: :func:`validate_config` turns ``max_tokens`` into ``max_steps`` (:func:`resolve_max_tokens`), and a run then
sizes the model to ``match`` (:func:`resolve_match`) before it starts; both change the config in place, so that
config.yaml records what the run trained.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnlab.checks import check_choice, check_int, check_number, default_d_k
from attnlab.registry import unknown_name_message
from attnlab.runs import attention_sources, config_defaults, flatten_config, is_neutral

__all__ = [
    "CONF_DIR",
    "GROUPS",
    "ConfigError",
    "build_module",
    "check_group_choices",
    "check_override_text",
    "check_resolves",
    "config_changes",
    "group_choices",
    "import_user_modules",
    "match_count",
    "plain",
    "resolve_d_k",
    "resolve_match",
    "resolve_max_tokens",
    "set_threads",
    "validate_config",
]

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

# config groups a user picks on the command line (``group=choice``)
GROUPS = (
    "variant",
    "mask",
    "normalizer",
    "position_bias",
    "task",
    "model",
    "trainer",
    "logger",
    "experiment",
    "debug",
    "hparams_search",
)
# groups whose ``custom`` choice selects a name registered by the user's own module (through ``imports``)
CUSTOM_GROUPS = {
    "variant": "score",
    "mask": "mask",
    "normalizer": "normalizer",
    "position_bias": "position bias",
    "task": "task",
}

# keys that may differ between a run and its resume: they change how the run is watched, never its numbers
# keys a resume may raise: training goes on past the original end (an extension)
EXTENSION_KEYS = ("max_steps", "trainer.max_steps", "max_tokens")

MAX_STEPS = 10**9  # a billion optimizer steps (11 days at a millisecond each): beyond it a budget is a typo
MAX_THREADS_PER_CORE = 4  # more torch threads than this per core only slow a run (and a million crash torch)
TRAINER_PRECISIONS = ("32-true", "32", "64-true", "64", "16-mixed", "16", "bf16-mixed", "bf16", "16-true", "bf16-true")


def _launch_uid() -> str:
    """A random id drawn once per launch and inherited by the jobs it starts (through the environment)."""
    uid = os.environ.get("ATTNLAB_UID")
    if not uid:
        uid = os.environ["ATTNLAB_UID"] = secrets.token_hex(3)
    return uid


# ``${attnlab_uid:}`` in the run and sweep folder names. Cached in the config, so that a job that composes its
# config again (submitit, joblib) gets the launch's id even where the environment is not passed on.
OmegaConf.register_new_resolver("attnlab_uid", _launch_uid, replace=True, use_cache=True)


def job_dir_name(overrides: str, limit: int = 200) -> str:
    """A sweep job's folder name from its overrides (``hydra.job.override_dirname``): every character that could
    leave the sweep folder or break a shell (``/``, ``\\``, control characters) becomes ``_``, so that
    ``+tag=../../x`` names a folder *inside* the sweep; a name longer than ``limit`` bytes is cut and ends with a
    hash of the whole, so that two long sweeps' jobs stay apart and the file system takes the name."""
    import hashlib

    name = "".join("_" if ch in "/\\" or not ch.isprintable() else ch for ch in str(overrides))
    if len(name.encode()) > limit:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = name.encode()[: limit - 11].decode(errors="ignore") + "-" + digest
    return name


OmegaConf.register_new_resolver("attnlab_job_dir", job_dir_name, replace=True)


def rope_setting(pos_encoding: Any, rope: Any) -> Any:
    """``attention.rope`` from ``model.pos_encoding`` and ``model.rope``: the rotary parameters when the encoding is
    ``rope``, else None (off)."""
    return rope if pos_encoding == "rope" else None


OmegaConf.register_new_resolver("attnlab_rope", rope_setting, replace=True)


class ConfigError(ValueError):
    """A request that cannot start: a bad config value, or a run folder that does not allow it. One line."""


def plain(node: Any) -> Any:
    """An OmegaConf node as plain Python containers (resolved); anything else unchanged."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


# ------------------------------------------------------------------------------------------ before composing


def group_choices(conf_dir: Path, group: str) -> list[str]:
    """The options of a config group: the yaml files in ``conf_dir/group``."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def check_group_choices(overrides: Iterable[str], conf_dir: Path = CONF_DIR) -> None:
    """Reject ``group=choice`` overrides whose choice has no yaml file, before Hydra composes.

    Sweeps (``variant=dot,additive``) are checked item by item; ``null`` is allowed for optional groups. For a
    name that is not a file of ``variant`` or ``mask``, the message gives the route to a user-registered one.
    """
    for arg in overrides:
        if "=" not in arg or arg.startswith(("-", "+", "~", "hydra")):
            continue
        key, value = arg.split("=", 1)
        key = key.removeprefix("override ").strip()
        if key not in GROUPS or not (conf_dir / key).is_dir():
            continue
        values = value.split(",") if not value.startswith(("choice(", "range(", "interval(", "tag(")) else []
        for v in values:
            v = v.strip().strip("'\"")
            if v in ("null", ""):
                continue
            choices = group_choices(conf_dir, key)
            if v not in choices:
                message = unknown_name_message(key, v, choices)
                if key in CUSTOM_GROUPS:
                    message += f". Your own {CUSTOM_GROUPS[key]}: {key}=custom {key}.name={v} 'imports=[your_module]'"
                raise ConfigError(message)


# Hydra's command-line flags that take the next argument as their value (not an override)
_FLAGS_WITH_VALUE = (
    "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--cfg", "-c", "--package", "-p",
    "--info", "-i", "--experimental-rerun", "--shell-completion", "-sc",
)  # fmt: skip


def check_override_text(args: list[str]) -> None:
    """Every ``key=value`` of the command line is one Hydra's grammar reads, else one line naming the override,
    the first character it cannot read, and the fix: an unquoted non-ASCII value (``task.name=é``, as a shell
    passes it) must be quoted for Hydra (``"task.name='é'"``), instead of Hydra's lexer traceback. Flags (``-m``,
    ``--cfg job``) and their values are skipped; what Hydra reads is left to it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    skip = False
    for arg in args:
        if skip or arg.startswith("-"):
            skip = not skip and arg in _FLAGS_WITH_VALUE
            continue
        try:
            parser.parse_overrides([arg])
        except Exception as exc:  # (Hydra's grammar errors are several lines, with the lexer's traceback)
            raise ConfigError(_override_text_error(arg, str(exc))) from None


def _override_text_error(arg: str, error: str) -> str:
    """One line for Hydra's grammar ``error`` on override ``arg``: the character its lexer stopped at (the caret of
    its message, else the first that is not printable ASCII) and the quoted form, or the error's first line."""
    lines = error.strip().splitlines() or ["cannot be parsed"]
    odd = None
    if len(lines) > 1 and lines[0].endswith(arg) and "^" in lines[1]:
        at = lines[1].index("^") - (len(lines[0]) - len(arg))
        odd = arg[at] if 0 <= at < len(arg) else None
    if odd is None:
        odd = next((ch for ch in arg if not ch.isascii() or not ch.isprintable()), None)
    key, _, value = arg.partition("=")
    if odd is None or "'" in value or '"' in value:
        return f"cannot read the override {arg!r}: {lines[0]}"
    return (
        f"cannot read the override {arg!r}: Hydra's grammar takes no {odd!r} (U+{ord(odd):04X}) in an unquoted value "
        f"(only ASCII letters, digits and signs like _-+./:@); quote the value: \"{key}='{value}'\""
    )


# ------------------------------------------------------------------------------------------ the composed config


def import_user_modules(cfg: DictConfig) -> None:
    """Import the modules named in ``imports`` (their ``@register_score`` / ``@register_mask`` run)."""
    names = plain(cfg.get("imports")) or []
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"imports must be a list of module names, got {names!r}")
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any error in the user's module is a bad config, said in one line
            detail = " ".join(str(exc).split()) or type(exc).__name__
            raise ConfigError(f"imports: cannot import '{name}': {type(exc).__name__}: {detail}") from None


def _check(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _prefixed(prefix: str, exc: Exception, keys: Iterable[str]) -> ConfigError:
    """A builder's error as one line naming the config key: ``clip must be ...`` → ``variant.params.clip ...``."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    key = next((k for k in keys if message.startswith(f"{k} ")), None)
    return ConfigError(f"{prefix}{message}" if key else f"{prefix.rstrip('.')}: {message}")


def _flag(cfg: Any, key: str, name: str | None = None) -> None:
    """A boolean at ``key`` of ``cfg``; the error names it ``name`` (default ``key``)."""
    value = OmegaConf.select(cfg, key) if OmegaConf.is_config(cfg) else cfg.get(key)
    if not isinstance(value, bool):
        raise ConfigError(f"{name or key} must be true or false, got {value!r}")


def validate_config(cfg: DictConfig) -> Any:
    """Check the whole config (after :func:`import_user_modules`): sizes, numbers, names and parameters of the
    variant, mask, task and trainer, and whether the task's sequences fit in memory. Writes nothing.

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
    threads, most = cfg.get("threads", "auto"), MAX_THREADS_PER_CORE * (os.cpu_count() or 1)
    if threads not in (None, "auto") and (
        isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= most
    ):
        raise ConfigError(f"threads must be auto or an integer from 1 to {most} (4 per core here), got {threads!r}")
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


def _on_meta(build: Any) -> Any:
    """``build()`` on torch's meta device, where a module of any size takes no memory (its sizes are judged by
    :func:`_check_memory`); a user's module that needs real tensors to be built is built on the CPU instead. A bad
    value (TypeError, ValueError, :class:`ConfigError`) is raised either way."""
    import torch

    try:
        with torch.device("meta"):
            return build()
    except (TypeError, ValueError):
        raise
    except Exception:
        return build()


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
    from attnlab.encoder import POSITIONAL_ENCODINGS

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
    betas = plain(model.betas)
    if not isinstance(betas, list) or len(betas) != 2:
        raise ConfigError(f"model.betas must be two numbers in [0, 1), got {betas!r}")
    for beta in betas:
        _check(check_number, "model.betas", beta, 0.0, 1.0, high_open=True)


def _check_short_conv(key: str, value: Any) -> None:
    """``short_conv`` at ``key``: null (off) or the width k >= 1 of the causal convolution on q, k and v. ``0`` and
    ``false`` are refused: the library reads them as off, but a config.yaml that records ``short_conv: 0`` for a
    run without a convolution says something else."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(
            f"{key} must be null (off) or an integer >= 1 (the width k of the causal convolution on q, k and v), "
            f"got {value!r}"
        )


def _check_layer_changes(model: DictConfig) -> None:
    """The shapes of ``model.pattern``, ``model.layer_kinds`` and ``model.layers``, before any layer is built: a
    string of kind letters, a mapping of one-letter kinds to mappings of attention fields, a list of such mappings
    (null: the attention as configured). One line naming the key; each mapping's fields and ``short_conv`` are
    checked too, whether or not the pattern uses the kind."""
    from attnlab.config import FIELDS

    pattern = plain(model.get("pattern"))
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise ConfigError(f"model.pattern must be null or a string of layer kinds like LG, got {pattern!r}")
    like = "like {mask: causal}"
    kinds = plain(model.get("layer_kinds"))
    if kinds is not None and not isinstance(kinds, dict):
        raise ConfigError(f"model.layer_kinds must be a mapping of layer kinds (G, L, S: {like}), got {kinds!r}")
    changes = []
    for letter, change in (kinds or {}).items():
        if not isinstance(letter, str) or len(letter) != 1:
            raise ConfigError(f"model.layer_kinds.{letter}: a layer kind is one letter of model.pattern (like L)")
        changes.append((f"model.layer_kinds.{letter}", change))
    layers = plain(model.get("layers"))
    if layers is not None:
        if not isinstance(layers, list):
            raise ConfigError(
                "model.layers must be null or a list of one mapping of attention fields per layer "
                f"('[{{mask: causal}}, {{}}]'), got {layers!r}"
            )
        changes += [(f"model.layers[{i}]", change) for i, change in enumerate(layers)]
    for key, change in changes:
        if change is not None and not isinstance(change, dict):
            raise ConfigError(
                f"{key} must be a mapping of attention fields ({like}) or null (the attention as configured), "
                f"got {change!r}"
            )
        unknown = sorted(map(str, set(change or {}) - set(FIELDS)))
        if unknown:
            raise ConfigError(f"{key}: attention has no field '{unknown[0]}'; fields: {', '.join(FIELDS)}")
        if "short_conv" in (change or {}):
            _check_short_conv(f"{key}.short_conv", change["short_conv"])


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
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
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


ATTENTION_TARGET = "attnlab.config.AttentionConfig"


def _field_error(exc: Exception, prefix: str = "") -> ConfigError:
    """An :class:`~attnlab.config.AttentionConfig` error (``softcap must be ...``) naming the config key the field
    comes from (``d_v must be`` → ``model.d_v must be``); ``prefix`` names a layer kind's changes."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    for name, key in attention_sources().items():
        if message.startswith(f"{name} ") and not prefix:
            return ConfigError(key + message[len(name) :])
    return ConfigError(f"{prefix}{message}")


def attention_configs(cfg: DictConfig) -> list[Any]:
    """Each layer's :class:`~attnlab.config.AttentionConfig`: the ``attention`` node built (its ``_target_`` must
    be :class:`~attnlab.config.AttentionConfig`, and is never imported: a config may come from a folder someone
    else wrote), then changed per layer by ``model.pattern`` / ``model.layer_kinds`` or ``model.layers``
    (:func:`~attnlab.config.layer_configs`). One :class:`ConfigError` line for a bad field."""
    from attnlab.config import layer_configs

    base = base_attention(cfg)
    m = cfg.model
    _check_layer_changes(m)
    try:
        return layer_configs(
            base, cfg.num_layers, m.get("pattern"), plain(m.get("layer_kinds")), plain(m.get("layers"))
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(" ".join(str(exc).split())) from None


def base_attention(cfg: DictConfig) -> Any:
    """The ``attention`` node, built: every layer's config before per-layer changes."""
    from attnlab.config import AttentionConfig

    node = plain(cfg.get("attention")) or {}
    if not isinstance(node, dict):
        raise ConfigError(f"attention must be a mapping of AttentionConfig fields, got {node!r}")
    target = node.pop("_target_", ATTENTION_TARGET)
    if target != ATTENTION_TARGET:
        raise ConfigError(f"attention._target_ must be {ATTENTION_TARGET}, got {target!r}")
    unknown = sorted(set(node) - set(attention_sources()))
    if unknown:
        raise ConfigError(f"attention has no field '{unknown[0]}'; fields: {', '.join(attention_sources())}")
    try:
        return AttentionConfig(**node)
    except (TypeError, ValueError) as exc:
        raise _field_error(exc) from None


def _layer_key(cfg: DictConfig, index: int) -> str:
    """Where layer ``index``'s changes come from (``model.layer_kinds.L.``, ``model.layers[1].``), or ``""``."""
    m = cfg.model
    if m.get("layers") is not None:
        return f"model.layers[{index}]."
    if m.get("pattern"):
        pattern = str(m.pattern)
        return f"model.layer_kinds.{pattern[index % len(pattern)]}."
    return ""


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
    from attnlab.config import build_preset, is_preset, list_presets
    from attnlab.masks import build_mask, list_masks
    from attnlab.normalizers import build_normalizer, list_normalizers
    from attnlab.position_bias import build_position_bias, list_position_biases
    from attnlab.positions import RotaryEmbedding
    from attnlab.scores import build_score, list_scores

    src = attention_sources() if not where else {f: f"{where}{f}" for f in attention_sources()}
    d_k = default_d_k(cfg.d_model, cfg.num_heads, config.d_k)
    heads = cfg.num_heads * (2 if config.differential else 1)  # differential: two maps per head
    sizes = {"d_k": d_k, "num_heads": heads, "d_v": config.d_v or d_k}

    name, params = config.score, config.score_params
    variants = sorted({*list_scores(), *list_presets()})
    if name not in variants:
        message = unknown_name_message("variant", name, variants)
        raise ConfigError(f"{message}. A score of your own: variant=custom variant.name=<name> 'imports=[module]'")
    prefix = src["score_params"] + "."
    try:
        if is_preset(name):
            changes = build_preset(name, **params)
            name, params = changes.get("score", "scaled_dot"), changes.get("score_params", {})
        build_score(name, **sizes, **params)
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


def _memory_bytes(trainer: DictConfig) -> tuple[int, str]:
    """(bytes, where) of the memory the attention tensors will live in."""
    import torch

    if str(trainer.get("accelerator")) in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "GPU memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "memory"


def _check_memory(cfg: DictConfig, datamodule: Any, attention_layers: list[Any]) -> None:
    """Refuse, before generating anything, what cannot fit in memory: the model's parameters with their gradients
    and optimizer state, sequences whose data or dense attention tensors, and then the layers' state (the recurrent
    state or key/value cache :meth:`~attnlab.attention.MultiHeadAttention.state_size` reports) for a batch."""
    from attnlab.scores import DotProductScore

    length, heads, layers = datamodule.max_len, cfg.num_heads, cfg.num_layers
    sequences = datamodule.num_train + datamodule.num_val + datamodule.num_test
    needs = [(sequences * length * 8 * (2 if datamodule.per_token else 1), "the token and label tensors")]
    if cfg.diagnostics.enabled:  # the probe runs the eager path: weights and logits of every layer, float32
        # (with diagnostics.heads, the repeated-token probe's too, while the first probe's are held)
        probes = 2 if cfg.diagnostics.get("heads") and getattr(datamodule, "no_token_probe", None) is None else 1
        needs.append((probes * cfg.diagnostics.probe_size * heads * length**2 * 8 * layers, "the diagnostics probe"))
    fused = all(
        (
            attention.uses_fast_path
            and type(attention.score).bias is DotProductScore.bias
            and attention.position_bias is None
            and not attention.differential
        )
        or attention.backend_for() in ("chunked", "global", "recurrent")  # linear attention in O(L)
        for attention in attention_layers
    )
    if not fused:  # the eager path or SDPA's math kernel: (B, H, L, L) weights, logits and gradients per layer
        needs.append((cfg.batch_size * heads * length**2 * 4 * 3 * layers, "a training batch's attention"))
    params = _parameter_count(cfg, datamodule)
    if params is not None:  # weights, gradients and AdamW's two moments, float32
        needs.append((params * 4 * 4, f"{params:,} parameters with their gradients and optimizer state"))
    have, where = _memory_bytes(cfg.trainer)
    need, what = max(needs)
    if need > 0.8 * have and params is not None and what.endswith("optimizer state"):
        sizes = {"d_model": cfg.d_model, "d_k": cfg.d_k, "num_heads": cfg.num_heads, "num_layers": cfg.num_layers}
        sizes |= {"model.d_ff": cfg.model.d_ff, "model.d_v": cfg.model.d_v}
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items() if v is not None)
        raise ConfigError(
            f"{shown}: the model needs about {_size(need)} for {what}, more than the {_size(have)} of {where} here; "
            "choose smaller sizes"
        )
    if need > 0.8 * have:
        key = next((k for k in datamodule.length_keys if cfg.task.datamodule.get(k) is not None), None)
        setting = f"task.datamodule.{key}={cfg.task.datamodule[key]}" if key else f"task={cfg.task.name}"
        raise ConfigError(
            f"{setting}: sequences of {length} tokens need about {_size(need)} for {what}, more than the "
            f"{_size(have)} of {where} here; use shorter sequences (or a smaller batch / diagnostics.probe_size)"
        )
    # the layers' recurrent state or key/value cache: a linear feature map of 1e10 dimensions (taylor's d + d² + 1)
    state = sum(attention.state_size(length) for attention in attention_layers)
    if cfg.batch_size * state * 4 > 0.8 * have:  # a training batch's state (the chunked form holds more), float32
        variant = " ".join(
            [f"variant.name={cfg.variant.name}"]
            + [f"variant.params.{k}={v}" for k, v in (plain(cfg.variant.get("params")) or {}).items()]
        )
        raise ConfigError(
            f"{variant} (d_k={resolve_d_k(cfg)}, num_heads={heads}, num_layers={layers}): the layers' state is "
            f"{state:,} floats per sequence (state_size at {length} tokens), about {_size(cfg.batch_size * state * 4)} "
            f"for a batch of {cfg.batch_size}, more than the {_size(have)} of {where} here; choose a smaller state "
            "(variant.params, d_k, num_heads) or batch_size"
        )


def _parameter_count(cfg: DictConfig, datamodule: Any) -> int | None:
    """The model's parameter count, built on the meta device (no memory); None when it cannot be built there."""
    import torch

    try:
        with torch.device("meta"):
            return build_module(cfg, datamodule).num_parameters
    except Exception:
        return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


# ------------------------------------------------------------------------------------------ budgets

MATCH_KEYS = ("by", "width", "target", "reference")
MATCH_BY = ("params", "state_size")
MATCH_MAX_WIDTH = 1 << 20
"""The widest width that ``match`` tries (models are built on the meta device: no memory)."""


def _whole(name: str, value: Any) -> int | None:
    """``value`` as an integer >= 1, also when written as a float (``max_tokens=2e6``); None stays None."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return _check(check_int, name, value, minimum=1)


def _whole_key(cfg: DictConfig, key: str) -> int | None:
    """:func:`_whole` of ``cfg``'s ``key``, written back as an integer (config.yaml records ``2000000``, not
    ``2000000.0``)."""
    value = _whole(key, OmegaConf.select(cfg, key))
    if value is not None and type(OmegaConf.select(cfg, key)) is not int:
        OmegaConf.update(cfg, key, value)
    return value


def _check_budgets(cfg: DictConfig) -> None:
    """``max_tokens`` (null or an integer >= 1) and the ``match`` node: its keys, ``by`` with one target (a count or
    a reference variant), and ``width`` an integer key of the config."""
    _whole_key(cfg, "max_tokens")
    match = cfg.get("match")
    if match is None:
        return
    if not OmegaConf.is_dict(match):
        raise ConfigError(f"match must be a mapping of {', '.join(MATCH_KEYS)}, got {plain(match)!r}")
    unknown = sorted(set(map(str, match)) - set(MATCH_KEYS))
    if unknown:
        raise ConfigError(f"match has no key '{unknown[0]}'; its keys: {', '.join(MATCH_KEYS)}")
    by, target, reference = match.get("by"), match.get("target"), match.get("reference")
    if by is None:
        given = next((k for k in ("target", "reference") if match.get(k) is not None), None)
        if given:
            raise ConfigError(f"match.{given} is set but match.by is null: set match.by=params or match.by=state_size")
        return
    _check(check_choice, "match.by", by, MATCH_BY)
    _whole_key(cfg, "match.target")
    if (target is None) == (reference is None):
        both = "both are set" if target is not None else "neither is set"
        raise ConfigError(
            f"match.by={by} matches one count: set match.target=<count> or match.reference=<variant>, not both ({both})"
        )
    if reference is not None:
        choices = [c for c in group_choices(CONF_DIR, "variant") if c != "custom"]
        if not isinstance(reference, str) or reference not in choices:
            raise ConfigError(f"match.reference: {unknown_name_message('variant', str(reference), choices)}")
    _width_value(cfg, match.get("width"))


def _width_value(cfg: DictConfig, key: Any) -> int | None:
    """The value of ``match.width``'s key: an integer or null (its default: d_ff = 4·d_model, d_k = d_model / H).
    A parameter of a stage (``variant.params.<name>``) may be absent (the builder's default)."""
    import difflib
    import re

    if not isinstance(key, str) or not re.fullmatch(r"\w+(\.\w+)*", key):
        raise ConfigError(
            "match.width must name an integer key of the config (model.d_ff, d_k, variant.params.<name> ...), got "
            f"{key!r}"
        )
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    optional = parent_key.endswith("params")
    if not OmegaConf.is_dict(parent) or (leaf not in parent and not optional):
        keys = [k for k, v in flatten_config(plain(cfg)).items() if v is None or type(v) is int]
        close = difflib.get_close_matches(key, keys, n=1)
        hint = f"; did you mean {close[0]}?" if close else " (e.g. model.d_ff, d_k, variant.params.<name>)"
        raise ConfigError(f"match.width={key} is not a key of the config{hint}")
    value = parent.get(leaf)
    if value is not None and type(value) is not int:
        raise ConfigError(f"match.width={key}: {key} is {value!r}, not an integer (the width is searched in integers)")
    return value


def resolve_max_tokens(cfg: DictConfig, datamodule: Any) -> int | None:
    """With ``max_tokens`` set: ``max_steps`` = ceil(max_tokens / tokens per step), where a step takes batch_size ·
    seq_len (· ``trainer.accumulate_grad_batches``) token positions of one process, rounded up to a multiple of
    ``eval_every`` (the run validates, and saves its checkpoint, at its last step); set in ``cfg`` (``max_tokens``
    overrides ``max_steps``) and returned. None when ``max_tokens`` is null."""
    max_tokens = _whole("max_tokens", cfg.get("max_tokens"))
    if max_tokens is None:
        return None
    from attnlab.compute import tokens_per_step

    accumulate = cfg.trainer.get("accumulate_grad_batches") or 1
    per_step = tokens_per_step(datamodule.batch_size, datamodule.seq_len, accumulate=accumulate)
    steps = -(-max_tokens // per_step)
    steps = -(-steps // cfg.eval_every) * cfg.eval_every
    if steps > MAX_STEPS:
        most = MAX_STEPS // cfg.eval_every * cfg.eval_every * per_step
        raise ConfigError(
            f"max_tokens={max_tokens:.3g} makes {steps:.3g} steps of {per_step:,} tokens (batch_size × seq_len), "
            f"more than the {MAX_STEPS:,} steps a run may take; allowed: null or an integer from 1 to {most:,}"
        )
    OmegaConf.update(cfg, "max_steps", steps)
    return steps


def match_count(cfg: DictConfig, datamodule: Any, by: str, where: str = "") -> int:
    """The count that ``match.by`` matches, of the model ``cfg`` builds for ``datamodule`` (on the meta device):
    its parameters (``params``), or its layers' summed ``state_size`` at the task's longest sequence."""
    try:
        module = _on_meta(lambda: build_module(cfg, datamodule))
    except (TypeError, ValueError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"match: the model with {where or 'this config'} cannot be built: {message}") from None
    if by == "params":
        return int(module.num_parameters)
    length = module.hparams.get("max_len") or 0
    return int(sum(layer.self_attn.state_size(length) for layer in module.encoder.layers))


def resolve_match(cfg: DictConfig, datamodule: Any) -> dict[str, Any] | None:
    """``match.by`` set: the integer ``match.width`` whose model's count (:func:`match_count`) is closest to
    ``match.target``, or to the count of this config with ``variant=<match.reference>`` (and this run's width), by
    bisection (the count must not decrease as the width grows), set in ``cfg``; returns ``{by, width, value, target,
    achieved, reference}`` (``value`` the width found, ``achieved`` its count). None when ``match.by`` is null. One
    :class:`ConfigError` line when no width comes near the target. Check the config again afterwards
    (:func:`validate_config`): the model has changed."""
    match = cfg.get("match")
    if match is None or match.get("by") is None:
        return None
    from attnlab.compute import Unreachable, closest_width

    by, key, reference = str(match.by), str(match.width), match.get("reference")
    if reference is not None:
        target = match_count(_with_variant(cfg, str(reference)), datamodule, by, f"variant={reference}")
    else:
        target = _whole("match.target", match.get("target"))

    def count(width: int) -> int:
        OmegaConf.update(cfg, key, width, force_add=True)
        return match_count(cfg, datamodule, by, f"{key}={width}")

    try:
        width, achieved = closest_width(count, target, high=MATCH_MAX_WIDTH)
    except Unreachable as exc:
        what = f"the {by} of variant={reference} ({target:,})" if reference is not None else f"{target:,} {by}"
        raise ConfigError(f"match.by={by}: no {key} reaches {what}: {exc}") from None
    OmegaConf.update(cfg, key, width, force_add=True)
    return {"by": by, "width": key, "value": width, "target": target, "achieved": achieved, "reference": reference}


def _compose(overrides: list[str]) -> dict[str, Any]:
    """conf/config.yaml composed with ``overrides``, unresolved, without the ``hydra`` node (through the running
    Hydra app's search path when there is one)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        cfg = compose("config", overrides=overrides)
    else:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=False)


def _variant_choice(cfg: DictConfig) -> str:
    """The ``variant`` option ``cfg`` was composed with: Hydra's record of it (a preset: ``rope``), else the
    variant's name when a yaml file has it, else ``custom``."""
    from hydra.core.hydra_config import HydraConfig

    name = OmegaConf.select(cfg, "variant.name")
    if HydraConfig.initialized():
        choice = HydraConfig.get().runtime.choices.get("variant")
        if choice and (CONF_DIR / "variant" / f"{choice}.yaml").exists():
            return str(choice)
    return name if isinstance(name, str) and (CONF_DIR / "variant" / f"{name}.yaml").exists() else "custom"


def _with_variant(cfg: DictConfig, reference: str) -> DictConfig:
    """``cfg`` with ``variant=<reference>``: the reference's ``variant`` node, and every other key that the two
    variants' files set differently (``normalizer``, ``model.pos_encoding``, ``model.differential`` ...) as the
    reference's sets it; the rest as in ``cfg``."""
    current = _variant_choice(cfg)
    before, after = _compose([f"variant={current}"]), _compose([f"variant={reference}"])
    if (before.get("variant") or {}).get("name") != OmegaConf.select(cfg, "variant.name"):
        name = OmegaConf.select(cfg, "variant.name")  # (a stale record of another run's choice)
        exists = isinstance(name, str) and (CONF_DIR / "variant" / f"{name}.yaml").exists()
        before = _compose([f"variant={name if exists else 'custom'}"])
    config = OmegaConf.to_container(cfg, resolve=False)
    config["variant"] = after["variant"]
    _apply_changes(config, before, after, skip=("variant",))
    return OmegaConf.create(config)


def _apply_changes(target: dict[str, Any], before: dict[str, Any], after: dict[str, Any], skip: tuple = ()) -> None:
    """Set in ``target`` every leaf where ``after`` differs from ``before`` (removed where ``after`` lacks it)."""
    absent = object()
    for key in before.keys() | after.keys():
        if key in skip:
            continue
        old, new = before.get(key, absent), after.get(key, absent)
        if isinstance(old, dict) and isinstance(new, dict) and isinstance(target.get(key), dict):
            _apply_changes(target[key], old, new)
        elif old != new:
            if new is absent:
                target.pop(key, None)
            else:
                target[key] = copy.deepcopy(new)


# ------------------------------------------------------------------------------------------ what the config builds


def resolve_d_k(cfg: DictConfig) -> int:
    """``d_k`` or, when it is null, ``d_model // num_heads`` (which must then divide evenly)."""
    return default_d_k(cfg.d_model, cfg.num_heads, cfg.d_k)


def set_threads(cfg: DictConfig) -> int:
    """Set torch's CPU threads from ``cfg.threads``: an integer, or ``auto`` = ``$OMP_NUM_THREADS`` when set, else
    all cores divided among the jobs that a parallel launcher (joblib) runs at once, so that two jobs on two cores
    do not fight over four threads, or a submitit job's ``cpus_per_task``."""
    import torch
    from hydra.core.hydra_config import HydraConfig

    threads = cfg.get("threads", "auto")
    if threads in (None, "auto") and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = int(os.environ["OMP_NUM_THREADS"]) or None
    if threads in (None, "auto"):
        cores = os.cpu_count() or 1
        parallel = 1
        if HydraConfig.initialized():
            launcher = HydraConfig.get().launcher
            target = str(launcher.get("_target_", "")).lower()
            if "joblib" in target:
                n_jobs = launcher.get("n_jobs", -1) or -1
                parallel = cores if n_jobs < 0 else n_jobs
            elif "submitit" in target and launcher.get("cpus_per_task"):
                cores = int(launcher.cpus_per_task)  # what SLURM gave the job (submitit: cpus_per_task)
        threads = max(1, cores // max(1, parallel))
    torch.set_num_threads(int(threads))
    return int(threads)


def build_module(cfg: DictConfig, datamodule: Any, schedule_steps: int | None = None) -> Any:
    """The EncoderModule for ``cfg`` sized to the task ``datamodule``. The learning-rate schedule spans
    ``schedule_steps`` (default ``max_steps``; an extended run keeps its original schedule)."""
    from attnlab.module import EncoderModule

    m = cfg.model
    steps = schedule_steps or cfg.max_steps
    configs = attention_configs(cfg)
    return EncoderModule(
        vocab_size=datamodule.vocab_size,
        num_classes=datamodule.num_classes,
        per_token=datamodule.per_token,
        pad_id=datamodule.pad_id,
        max_len=datamodule.max_len,
        d_model=cfg.d_model,
        num_heads=cfg.num_heads,
        num_layers=cfg.num_layers,
        d_k=resolve_d_k(cfg),
        d_ff=m.d_ff,
        attention=[c.to_dict() for c in configs],
        pattern=m.get("pattern"),
        pos_encoding=m.pos_encoding,
        norm_first=m.norm_first,
        dropout=m.dropout,
        lr=cfg.lr,
        weight_decay=m.weight_decay,
        warmup_steps=min(m.warmup_steps, max(1, steps // 5)),
        max_steps=steps,
        betas=tuple(m.betas),
        test_lengths=tuple(getattr(datamodule, "test_lengths", ())),
        report_bits=bool(getattr(datamodule, "reports_bits", False)),
        chance_accuracy=getattr(datamodule, "chance_accuracy", None),
    )


# ------------------------------------------------------------------------------------------ resume


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The keys whose values differ between a run's config and a new one, as (key, old, new), leaving out the
    neutral keys (logger, threads, ...) that cannot change the numbers. A missing key reads as ``<absent>``; a
    top-level key that a run of an older attnlab lacks is no change when the new value is its default."""
    a, b = flatten_config(old), flatten_config(new)
    absent = "<absent>"
    defaults = config_defaults()
    added = {
        **_ADDED_IN_0_4,
        **_added_in_0_5(),
        **_added_in_0_6(),
        **(_added_defaults() if "attention" not in old else {}),
    }
    changes = [
        (key, a.get(key, absent), b.get(key, absent))
        for key in sorted(a.keys() | b.keys())
        if a.get(key, absent) != b.get(key, absent)
        and not is_neutral(key)
        and not (key not in a and "." not in key and key in defaults and defaults[key] == b.get(key))
        and not (key not in a and _added_default(added, key) in (b.get(key), _DERIVED))
    ]
    changed = [key for key, _, _ in changes]
    return [c for c in changes if not _mirrors_a_change(c[0], changed)]


def _mirrors_a_change(key: str, changed: list[str]) -> bool:
    """Whether ``key`` is a field of the ``attention`` node that interpolates a key which changed too
    (``attention.d_k`` ← ``d_k``, ``attention.score_params.clip`` ← ``variant.params``): a change is listed once,
    under the key that was set."""
    if not key.startswith("attention."):
        return False
    field = key.removeprefix("attention.").partition(".")[0]
    source = attention_sources().get(field)
    if source is None or source.startswith("attention."):
        return False
    sources = [source, "model.pos_encoding"] if field == "rope" else [source]
    return any(c == s or c.startswith(f"{s}.") for s in sources for c in changed)


def _added_default(added: dict[str, Any], key: str) -> Any:
    """What a run without ``key`` ran with, from ``added`` (by the key or the nearest node above it)."""
    while key:
        if key in added:
            return added[key]
        key = key.rpartition(".")[0]
    return "<not added>"


_DERIVED = object()

_ADDED_IN_0_4: dict[str, Any] = {
    "model.short_conv": None,
    "attention.short_conv": _DERIVED,
    "attention.backend_params": {},
    "model.layer_kinds.S": _DERIVED,
}
"""The keys that a run of attnlab 0.3 lacks, with the value it ran with (no short convolution, no backend
parameters)."""


def _added_in_0_6() -> dict[str, Any]:
    """The keys that a run of attnlab 0.5 lacks (what the heads do: ``diagnostics.heads`` ...), with the value it ran
    with: none of it (a resume adds the new diagnostics from there on, which changes no trained number)."""
    return {key: value for key, value in config_defaults().items() if key in _DIAGNOSTICS_0_6}


_DIAGNOSTICS_0_6 = (
    "diagnostics.heads",
    "diagnostics.window",
    "diagnostics.near_keys",
    "diagnostics.importance",
    "diagnostics.random_orders",
)


def _added_in_0_5() -> dict[str, Any]:
    """The keys that a run of attnlab 0.4 lacks (the ``match`` node; ``max_tokens`` is a top-level default), with the
    value it ran with: no matching."""
    return {key: value for key, value in config_defaults().items() if key.startswith("match.")}


@functools.cache
def _added_defaults() -> dict[str, Any]:
    """The keys that a run of attnlab 0.2 (before the ``attention`` node and per-layer attention) lacks, with the
    value it ran with: the ``attention`` node's fields derive from keys such a run has (compared there), its
    ``backend`` was ``auto``, and every layer was alike."""
    model = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "default.yaml"), resolve=False)
    added: dict[str, Any] = {f"attention.{k}": _DERIVED for k in attention_sources()}
    added |= {"attention._target_": _DERIVED, "attention.backend": "auto", "model.rope.spectrum": "full"}
    for key in ("pattern", "local_window", "layers"):
        added[f"model.{key}"] = model.get(key)
    added["model.layer_kinds"] = _DERIVED
    return added
