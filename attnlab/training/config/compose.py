"""From the command line to a composed config, and from a config to what it builds.

Before Hydra composes: :func:`check_group_choices` (an unknown ``variant=adittive`` gets "did you mean
'additive'?") and :func:`check_override_text` (text Hydra's grammar cannot read: an unquoted ``task.name=é``). The
resolvers the yaml files use (``${attnlab_uid:}``, ``${attnlab_job_dir:...}``, ``${attnlab_rope:...}``), registered
on import, and :func:`job_dir_name`. After composing: the user's ``imports`` (:func:`import_user_modules`),
composing again with another variant (:func:`_with_variant`, for ``match.reference``), each layer's
:class:`~attnlab.config.AttentionConfig` from the ``attention`` node and ``model.pattern`` / ``model.layer_kinds`` /
``model.layers`` (:func:`attention_configs`, with the shape checks of those keys), and what a run builds from the
config: the module (:func:`build_module`), ``d_k`` (:func:`resolve_d_k`) and torch's threads (:func:`set_threads`).
"""

from __future__ import annotations

import copy
import importlib
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnlab.checks import default_d_k
from attnlab.registry import unknown_name_message
from attnlab.runs import attention_sources
from attnlab.training.config.base import CONF_DIR, CUSTOM_GROUPS, GROUPS, ConfigError, plain

__all__ = [
    "ATTENTION_TARGET",
    "attention_configs",
    "base_attention",
    "build_module",
    "check_group_choices",
    "check_override_text",
    "group_choices",
    "import_user_modules",
    "job_dir_name",
    "launcher_share",
    "resolve_d_k",
    "rope_setting",
    "set_threads",
]


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


# ------------------------------------------------------------------------------------------ before composing


def group_choices(conf_dir: Path, group: str) -> list[str]:
    """The options of a config group: the yaml files in ``conf_dir/group``, and the options registered in Hydra's
    ConfigStore (the forms' named settings and the comparisons' models, :mod:`attnlab.training.compare`: a
    subgroup's option as ``<subgroup>/<name>``)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()

    def listed(path: str) -> list[str]:
        try:
            return list(store.list(path))
        except OSError:  # (no such group in the store)
            return []

    stored = []
    for entry in listed(group):
        if entry.endswith(".yaml"):
            stored.append(entry.removesuffix(".yaml"))
        else:
            stored += [f"{entry}/{m.removesuffix('.yaml')}" for m in listed(f"{group}/{entry}") if m.endswith(".yaml")]
    return sorted({*(p.stem for p in (conf_dir / group).glob("*.yaml")), *stored})


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


# ------------------------------------------------------------------------------------------ the attention node


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
    from attnlab.encoder import canon_points, with_canon_b

    base = base_attention(cfg)
    m = cfg.model
    _check_layer_changes(m)
    try:
        configs = layer_configs(
            base, cfg.num_layers, m.get("pattern"), plain(m.get("layer_kinds")), plain(m.get("layers"))
        )
        if "B" in canon_points(m.get("canon")):  # Canon-B: each layer's short convolution, with a residual
            width = m.get("canon_width", 4)
            configs = [with_canon_b(c, width, f"layer {n}") for n, c in enumerate(configs, start=1)]
        return configs
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


# ------------------------------------------------------------------------------------------ what the config builds


def resolve_d_k(cfg: DictConfig) -> int:
    """``d_k`` or, when it is null, ``d_model // num_heads`` (which must then divide evenly)."""
    return default_d_k(cfg.d_model, cfg.num_heads, cfg.d_k)


def set_threads(cfg: DictConfig) -> int:
    """Set torch's CPU threads from ``cfg.threads`` and return the count: an integer, or ``auto``
    (:func:`attnlab.cores.auto_threads`, the one rule that ``--dry-run`` plans with too): ``$OMP_NUM_THREADS`` when
    set, else a submitit job's ``cpus_per_task``, else the cores this process may have (affinity, cgroup quota)
    less those other work keeps busy now, divided among the jobs that joblib runs at once, so that a run on a
    busy machine, or two jobs on two cores, do not fight over more threads than there are free cores (a step with
    two threads on a 2-core machine whose other core is busy took 19x as long as with one)."""
    import torch

    from attnlab.cores import auto_threads

    parallel, cpus_per_task = launcher_share()
    choice = auto_threads(parallel, cfg.get("threads", "auto"), cpus_per_task, launched=parallel > 1)
    torch.set_num_threads(choice.threads)
    return choice.threads


def launcher_share(launcher: Any = None) -> tuple[int, int | None]:
    """``(jobs run at once, cpus per job)`` of a multirun's launcher (``launcher``: its ``hydra.launcher`` node;
    default: the running Hydra app's, none outside one): joblib's ``n_jobs`` (``-1``: every core this process may
    have) and no count; a submitit launcher's ``cpus_per_task`` (None when unset) on one job; else ``(1, None)``."""
    from hydra.core.hydra_config import HydraConfig

    from attnlab.cores import available_cores

    if launcher is None:
        if not HydraConfig.initialized():
            return 1, None
        launcher = HydraConfig.get().launcher
    target = str(launcher.get("_target_", "") or "").lower()
    if "joblib" in target:
        n_jobs = int(launcher.get("n_jobs", -1) or -1)  # (joblib's: -1 every core, -2 all but one ...)
        return (max(1, available_cores() + 1 + n_jobs) if n_jobs < 0 else n_jobs), None
    if "submitit" in target and launcher.get("cpus_per_task"):
        return 1, int(launcher.cpus_per_task)
    return 1, None


def build_module(cfg: DictConfig, datamodule: Any, schedule_steps: int | None = None) -> Any:
    """The EncoderModule for ``cfg`` sized to the task ``datamodule``, each layer's attention the
    :class:`~attnlab.config.AttentionConfig` that :func:`attention_configs` builds (given to the module as it is).
    The learning-rate schedule spans ``schedule_steps`` (default ``max_steps``; an extended run keeps its original
    schedule)."""
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
        attention=configs,
        pattern=m.get("pattern"),
        pos_encoding=m.pos_encoding,
        canon=m.get("canon"),
        canon_width=m.get("canon_width", 4),
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
