"""Named models and comparisons: the comparison a researcher asks for, as one command.

A **named model** is what every reader of a run calls it (``summary.json``'s ``model``, the dashboard's
configuration, the card's and the studies' rows: :func:`model_name`):

* a ``variant=`` option: a yaml of ``conf/variant`` (a form, with the layer settings its preset brings), or a
  form's **named setting** (:attr:`attnlab.forms.Form.settings`): ``variant=gated_deltanet_beta2`` is
  ``variant=gated_deltanet variant.params.beta_range=2``, registered here for every built-in form that has a
  ``conf/variant`` yaml, so that a new form's settings need no file (a yaml of the same name wins);
* a **model of a comparison**: ``compare=<comparison>/<model>``, a variant plus the comparison's shared settings
  plus the model's own.

A **comparison** is ``conf/compare/<name>.yaml`` (or a file of yours: ``compare=path/to/file.yaml``), run as one
sweep::

    python train.py -m compare=state_tracking              # every model on every seed the file lists
    python train.py -m compare=state_tracking --dry-run    # its plan, and the settings that differ between models
    python train.py -m compare=state_tracking hydra/sweeper=tuned   # each model tuned first, then its seeds
    python train.py compare=state_tracking/rwkv7           # one model of it, one run
    python train.py compare=path/to/mine.yaml:a            # one model of a file of yours
    python -m attnlab.compare [state_tracking]             # the named models and comparisons there are

The file is a Hydra config (``# @package _global_``) whose settings every model shares (its ``defaults`` list may
select groups: ``override /task: parity``), with one block that attnlab reads::

    compare:
      models:                  # name: {variant: <a variant option; default: the name>, <key>: <value>, ...}
        kda_beta2: {}          # the named setting as it is
        softmax: {variant: scaled_dot, model.pos_encoding: rope, normalizer: softmax1}
      seeds: [0, 1, 2]         # the sweep's seeds (hydra/sweeper=tuned keeps its own: 1, 2, 3 after tuning on 0)

A model's keys are config keys (dotted or nested) or a group's name (``normalizer: softmax1``: a group choice; a
mapping under a group's name, ``task: {datamodule: {...}}``, is that group's content). Every key the file sets must
be one the model's config has (:func:`check_comparison_keys`: a typo is one line, never dropped); a file of yours
may not take the name of a comparison of ``conf/compare``.

Why not Hydra's sweep over ``variant``: a sweep is a product of values, and a comparison is a list of models that
each change different keys (one needs ``model.pos_encoding=rope``, another ``beta_range=2``). Each model is therefore
registered in Hydra's ConfigStore (which Hydra carries into joblib and SLURM workers) as the option
``compare=<comparison>/<model>`` of the ``compare`` group, which comes after ``variant`` and ``experiment`` and
before ``debug`` in ``conf/config.yaml``'s defaults list. Its defaults list is the comparison's settings, then
``override /variant: <the model's variant>`` and its own group choices; then its own settings. So **a model's own
setting wins over the comparison's, which wins over the preset's** (``model.short_conv: 4`` in the file gives every
model the same convolution, whatever its preset turns on), and ``debug=fast`` and the command line win over all of
them. ``compare=<name>`` is expanded (:func:`expand_compare`) before Hydra sees the command line into
``compare=<name>/<m1>,<name>/<m2>,... seed=<seeds>``; ``compare=<name>/<m1>,<name>/<m2>`` runs some of the models,
``seed=`` replaces the file's seeds, and ``variant=`` beside ``compare=`` is refused (the models choose their
variants), as are several models under an Optuna search (``hparams_search=optuna``: it would search over the
models and the seeds as parameters; search one model, ``compare=<name>/<model>``). ``experiment=`` comes before
``compare`` in the defaults list: the comparison's settings win over an experiment's. The job's config holds
``compare: {name, model}``. Every comparison of ``conf/compare`` is registered whenever a command line is read, so
a resume (``compare=state_tracking/kda_beta2`` among the run's recorded overrides) composes as the run did; a
comparison in a file of yours is named again on a resume's command line (``resume=true hydra.run.dir=<run>
compare=path/to/file.yaml``: registered, and the run's own model applies); its models are
``compare=<file>.yaml:<model>`` on a command line, ``compare=<the file's stem>/<model>`` in a run's overrides.
"""

from __future__ import annotations

import functools
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnlab.training.config.base import CONF_DIR, GROUPS, ConfigError

__all__ = [
    "Comparison",
    "expand_compare",
    "load_comparison",
    "model_name",
    "named_settings",
    "register_comparison",
    "register_named_models",
    "variant_options",
]

COMPARE_DIR = CONF_DIR / "compare"
"""The comparisons that ship with attnlab (``compare=<name>``)."""
_SHARED_GROUP = "compare_settings"
"""The ConfigStore group holding each comparison's shared settings (its file less the ``compare`` block)."""
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_LOADED: dict[str, Comparison] = {}
"""The comparisons registered in this process, by name (a file of yours among them)."""


@dataclass(frozen=True)
class Comparison:
    """One comparison: its ``name`` (the file's stem), the ``path`` it was read from, its ``models`` (name -> the
    variant option it starts from and the model's own overrides, nested), its ``seeds`` (None: the config's seed),
    the ``shared`` settings (the file less its ``compare`` block) and the file's first comment lines
    (``description``)."""

    name: str
    path: Path
    models: dict[str, tuple[str, dict[str, Any]]]
    seeds: tuple[int, ...] | None
    shared: dict[str, Any] = field(repr=False)
    description: str = ""

    def option(self, model: str) -> str:
        """The ``compare`` option of one of its models: ``<comparison>/<model>``."""
        return f"{self.name}/{model}"


# ------------------------------------------------------------------------------------------------ named settings


def named_settings() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every built-in form's named setting that is a variant option: ``{"gated_deltanet_beta2": ("gated_deltanet",
    {"beta_range": 2}), ...}``, for the forms that have a ``conf/variant`` yaml (a form registered by a module of
    yours is selected with ``variant=custom``), less the names a yaml of ``conf/variant`` already has."""
    from attnlab.forms import form_settings

    files = set(_variant_files())
    return {
        s.label: (s.form, s.params) for s in form_settings() if s.params and s.form in files and s.label not in files
    }


def _variant_files() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "variant").glob("*.yaml"))


@functools.cache
def _registered_settings() -> tuple[str, ...]:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for label, (form, params) in named_settings().items():
        node = {"defaults": [form, "_self_"], "variant": {"params": dict(params)}}
        store.store(group="variant", name=label, node=node, package="_global_", provider="attnlab")
    return tuple(named_settings())


# ----------------------------------------------------------------------------------------------------- comparisons


def load_comparison(name_or_path: str) -> Comparison:
    """The comparison ``conf/compare/<name>.yaml``, or the file at a path (one ending ``.yaml``/``.yml`` or holding a
    ``/``), checked: one line (:class:`ConfigError`) naming what is wrong and what is allowed."""
    text = str(name_or_path).strip().strip("'\"")
    is_path = text.endswith((".yaml", ".yml")) or "/" in text
    path = Path(text).expanduser() if is_path else COMPARE_DIR / f"{text}.yaml"
    if not path.is_file():
        if is_path:
            raise ConfigError(f"compare={text}: no such file")
        from attnlab.registry import unknown_name_message

        raise ConfigError(
            unknown_name_message("comparison", text, comparison_names())
            + " (conf/compare), or a file of yours: compare=path/to/file.yaml"
        )
    name = path.stem
    shipped = COMPARE_DIR / f"{name}.yaml"
    if is_path and shipped.is_file() and path.resolve() != shipped.resolve():
        raise ConfigError(
            f"compare={text}: its name, {name}, is a comparison of conf/compare already (its runs would be "
            "read as that one's): rename the file"
        )
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{path}: a comparison's file name must be letters, digits, _ . - (it names its runs)")
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # (YAML errors are several lines)
        raise ConfigError(f"{path} is not a readable YAML file: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: a comparison is a mapping of settings with a compare: block, got a list")
    container = OmegaConf.to_container(raw, resolve=False)
    assert isinstance(container, dict)
    block = container.pop("compare", None)
    where = f"{path}: compare"
    if not isinstance(block, dict) or not isinstance(block.get("models"), dict) or not block["models"]:
        raise ConfigError(f"{where}.models must list the models, e.g. models: {{kda: {{}}, scaled_dot: {{}}}}")
    unknown = sorted(set(block) - {"models", "seeds"})
    if unknown:
        raise ConfigError(f"{where} has {', '.join(unknown)}; it takes models and seeds")
    seeds = block.get("seeds")
    if seeds is not None:
        if not isinstance(seeds, list) or not seeds or not all(type(s) is int for s in seeds):
            raise ConfigError(f"{where}.seeds must be a list of integers, e.g. [0, 1, 2], got {seeds!r}")
        seeds = tuple(seeds)
    models = {}
    options = set(variant_options())
    for model, spec in block["models"].items():
        model = str(model)
        if not _NAME.fullmatch(model):
            raise ConfigError(f"{where}.models: {model!r} is not a model name (letters, digits, _ . -)")
        spec = {} if spec is None else spec
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}.models.{model} must be a mapping of settings ({{variant: ..., key: value}})")
        spec = dict(spec)
        variant = str(spec.pop("variant", model))
        if variant not in options:
            from attnlab.registry import unknown_name_message

            raise ConfigError(
                f"{where}.models.{model}: {unknown_name_message('variant', variant, sorted(options))} "
                f"(give the model's variant: {model}: {{variant: <a variant>}})"
            )
        models[model] = (variant, _nested(spec, f"{where}.models.{model}"))
    return Comparison(name, path, models, seeds, container, _description(path))


def comparison_names() -> list[str]:
    """The comparisons of ``conf/compare``."""
    return sorted(p.stem for p in COMPARE_DIR.glob("*.yaml"))


def _nested(spec: dict[str, Any], where: str) -> dict[str, Any]:
    """``{"model.short_conv": 4, "variant": {"params": {...}}}`` as one nested mapping; a group's name
    (``normalizer: softmax1``) is kept as a group choice under the key ``/<group>``."""
    out: dict[str, Any] = {}
    for key, value in spec.items():
        key = str(key)
        if key in GROUPS and not isinstance(value, dict):  # a group's choice (a mapping: the group's content)
            if not isinstance(value, str) or value not in _group_options(key):
                raise ConfigError(f"{where}.{key}: {value!r} is not an option of conf/{key}")
            out[f"/{key}"] = value
            continue
        parts = key.split(".")
        if not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) for p in parts):
            raise ConfigError(f"{where}: {key!r} is not a config key (dotted names: model.short_conv)")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {key!r} sets a key inside {part}, which is given a value too")
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = OmegaConf.to_container(OmegaConf.merge(node[parts[-1]], value))
        else:
            node[parts[-1]] = value
    return out


def _group_options(group: str) -> list[str]:
    from attnlab.training.config import group_choices

    return group_choices(CONF_DIR, group)


def _description(path: Path) -> str:
    """The file's first comment lines (after its ``# @package`` header), joined."""
    lines = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("# @package"):
            continue
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith(("python ", "bash ")):
            break
        lines.append(text)
    return " ".join(lines)


def register_comparison(comparison: Comparison) -> list[str]:
    """Register ``comparison``'s shared settings and each of its models as the option
    ``compare=<name>/<model>`` (its defaults: ``override /variant: <the model's variant>``, the shared settings,
    the model's own group choices; then its own settings and ``compare: {name, model}``); its options, in the
    file's order."""
    from hydra.core.config_store import ConfigStore

    _registered_settings()
    _LOADED[comparison.name] = comparison
    store = ConfigStore.instance()
    store.store(
        group=_SHARED_GROUP, name=comparison.name, node=comparison.shared, package="_global_", provider="attnlab"
    )
    options = []
    for model, (variant, own) in comparison.models.items():
        own = dict(own)
        groups = [{f"override {k}": own.pop(k)} for k in [k for k in own if k.startswith("/")]]
        node = {
            "defaults": [f"/{_SHARED_GROUP}/{comparison.name}", {"override /variant": variant}, *groups, "_self_"],
            **own,
            "compare": {"name": comparison.name, "model": model},
        }
        store.store(group=f"compare/{comparison.name}", name=model, node=node, package="_global_", provider="attnlab")
        options.append(comparison.option(model))
    return options


@functools.cache
def register_named_models() -> tuple[str, ...]:
    """Register the named settings and every comparison of ``conf/compare`` (once a process); the variant options
    they add. A comparison that does not load is left out here: naming it (``compare=<name>``) says why."""
    options = list(_registered_settings())
    for name in comparison_names():
        try:
            options += register_comparison(load_comparison(name))
        except ConfigError:
            continue
    return tuple(options)


def variant_options() -> list[str]:
    """Every option of ``variant=``: the yaml files of ``conf/variant`` and the forms' named settings."""
    return sorted({*_variant_files(), *_registered_settings()})


# ----------------------------------------------------------------------------------------------- the command line


def _split(arg: str) -> tuple[str, str]:
    key, _, value = arg.partition("=")
    return key.lstrip("+~").removeprefix("override ").strip(), value.strip()


def _parse_wanted(value: str) -> tuple[Comparison, list[str], bool]:
    """``compare=``'s value as (the comparison, the models asked for, whether it named the whole comparison):
    ``<name>`` or a file (every model), ``<name>/<model>,<name>/<model>`` (a comparison of ``conf/compare``, or of
    a file registered in this process), ``<file>.yaml:<model>,<file>.yaml:<model>`` (a file's models)."""
    items = [v.strip().strip("'\"") for v in value.split(",")]
    parsed = []
    for item in items:
        path, colon, model = item.rpartition(":")
        if colon and path.endswith((".yaml", ".yml")):
            parsed.append((path, model))
        elif item.endswith((".yaml", ".yml")) or "/" not in item:
            parsed.append((item, None))
        else:
            source, _, model = item.rpartition("/")
            parsed.append((source, model))
    sources = {source for source, _ in parsed}
    if len(sources) > 1:
        raise ConfigError(
            "compare= takes one comparison, or models of one (compare=<name>/<model>,<name>/<model>), "
            f"got {', '.join(sorted(sources))}"
        )
    (source,) = sources
    comparison = _LOADED.get(source) or load_comparison(source)
    if any(model is None for _, model in parsed):
        if len(parsed) > 1:
            raise ConfigError(f"compare={value}: name the comparison once, or some of its models, not both")
        return comparison, list(comparison.models), True
    models = [model for _, model in parsed]
    unknown = [m for m in models if m not in comparison.models]
    if unknown:
        raise ConfigError(
            f"compare={value}: no model {', '.join(unknown)} in the comparison {comparison.name} "
            f"(its models: {', '.join(comparison.models)})"
        )
    return comparison, models, False


def expand_compare(args: Sequence[str]) -> list[str]:
    """The command line with ``compare=<name or file>`` expanded (see the module docstring): the comparison
    registered and its keys checked, and the override replaced by ``compare=<name>/<m1>,<name>/<m2>,...`` (every
    model, or those named: ``compare=<name>/<model>``, ``compare=<file>.yaml:<model>``) and, with ``-m``,
    ``seed=<the file's seeds>`` unless the command line gives ``seed=`` (the tuned sweeper keeps its own ``seeds``,
    which leave out its tuning seed). A single run (no ``-m``) runs one model; an Optuna search one model, on the
    seed it is given (it would search over the models and seeds otherwise). The named settings and every comparison
    of ``conf/compare`` are registered first, whatever the command line; ``compare=null`` and ``~compare`` are
    Hydra's."""
    register_named_models()
    args = list(args)
    given = [(i, *_split(a)) for i, a in enumerate(args) if "=" in a and not a.startswith("-")]
    compares = [(i, v) for i, k, v in given if k == "compare" and not args[i].startswith("~")]
    compares = [(i, v) for i, v in compares if v.strip("'\"") not in ("null", "")]
    if not compares:
        return args
    if len(compares) > 1:
        raise ConfigError("compare= is given twice; a command runs one comparison")
    index, value = compares[0]
    if any(k == "variant" for _, k, _ in given):
        raise ConfigError(
            "variant= beside compare=: a comparison's models choose their variants; to run some of its models, "
            "name them: compare=<comparison>/<model>,<comparison>/<model>"
        )
    comparison, models, whole = _parse_wanted(value)
    register_comparison(comparison)
    check_comparison_keys(comparison)
    values = {k: v.lower() for _, k, v in given}
    if whole and (values.get("resume") == "true" or values.get("ckpt_path") == "last"):
        del args[index]  # a resume: the comparison registered; the run's own compare=<name>/<model> applies
        return args
    multirun = any(a in ("-m", "--multirun") for a in args)
    optuna = any((k == "hparams_search" or k == "hydra/sweeper") and "optuna" in v for _, k, v in given)
    if (not multirun or optuna) and len(models) > 1:
        why = "an Optuna search would pick among them as a parameter" if optuna and multirun else "run them with -m"
        raise ConfigError(
            f"compare={comparison.name} has {len(models)} models ({', '.join(models)}): {why}, or one of them: "
            f"compare={comparison.name}/<model>"
        )
    expanded = [f"compare={','.join(comparison.option(m) for m in models)}"]
    keys = {k for _, k, _ in given}
    tuned = any(k == "hydra/sweeper" and v == "tuned" for _, k, v in given)
    if multirun and comparison.seeds is not None and not tuned and not optuna and "seed" not in keys:
        expanded.append(f"seed={','.join(str(s) for s in comparison.seeds)}")
    args[index : index + 1] = expanded
    return args


def check_comparison_keys(comparison: Comparison) -> None:
    """Every key the comparison's file sets, shared or a model's own, is a key of the config that model composes
    (its variant and the file's group choices, before the file's settings), else one line with the closest key:
    a typo is never dropped silently. A key the config lacks (a custom task's option) is added on the command line
    (``+task.datamodule.length=8``), as for a single run."""
    import difflib

    shared = {k: v for k, v in comparison.shared.items() if k not in ("defaults", "hydra")}
    groups = [_default_text(d) for d in comparison.shared.get("defaults", []) if isinstance(d, dict)]
    known_by: dict[tuple[str, ...], set[str]] = {}
    for model, (variant, own) in comparison.models.items():
        choices = tuple(
            [f"variant={variant}", *groups, *(f"{k.lstrip('/')}={v}" for k, v in own.items() if k.startswith("/"))]
        )
        if choices not in known_by:
            try:
                known_by[choices] = set(_flat_keys(OmegaConf.to_container(_compose(list(choices)), resolve=False)))
            except Exception:  # (what cannot compose is Hydra's to report, with the job)
                known_by[choices] = set()
        known = known_by[choices]
        if not known:
            continue
        content = {k: v for k, v in own.items() if not k.startswith("/")}
        for where, node in ((f"compare.models.{model}", content), ("the shared settings", shared)):
            for key in _flat(node):
                if key in known or any(k.startswith(key + ".") for k in known):
                    continue
                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(
                    f"{_shown(comparison.path)}: {where} sets '{key}', which the config of model {model} "
                    f"(variant={variant}) does not have{hint} (a key to add: +{key}=<value> on the command line)"
                )


def _compose(overrides: list[str]) -> DictConfig:
    """The config of ``overrides`` (inside a running Hydra app through its own loader, else on ``conf/``)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose("config", overrides=overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def _flat_keys(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a plain config (a mapping's own key too)."""
    if not isinstance(node, dict):
        return [prefix.rstrip(".")] if prefix else []
    keys = [prefix.rstrip(".")] if prefix else []
    for key, value in node.items():
        keys += _flat_keys(value, f"{prefix}{key}.")
    return keys


def model_name(cfg: DictConfig, variant_choice: str | None) -> str | None:
    """A run's model name: the comparison's model (``compare.model``), else the ``variant=`` choice (a yaml or a
    named setting), else, for ``variant=custom`` or a config composed without Hydra's choices, ``variant.name``."""
    model = OmegaConf.select(cfg, "compare.model", default=None)
    if model:
        return str(model)
    if variant_choice and variant_choice != "custom":
        return variant_choice.rsplit("/", 1)[-1]
    name = OmegaConf.select(cfg, "variant.name", default=None)
    return None if name is None else str(name)


# ------------------------------------------------------------------------------------------- python -m attnlab.compare


def describe(names: Iterable[str] = ()) -> str:
    """The text ``python -m attnlab.compare [name ...]`` prints: every named model and comparison, or each named
    comparison's models (their variant and own overrides) and settings."""
    names = list(names)
    if names:
        return "\n\n".join(_describe_one(load_comparison(n)) for n in names)
    lines = ["variants (variant=<name>): the yaml files of conf/variant"]
    lines += _columns(_variant_files())
    settings = named_settings()
    lines.append("")
    lines.append("named settings of the forms (variant=<name>: attnlab.forms.Form.settings)")
    for label, (form, params) in settings.items():
        lines.append(f"  {label:<28} {form} with " + ", ".join(f"{k}={v}" for k, v in params.items()))
    lines.append("")
    lines.append("comparisons (python train.py -m compare=<name>; python -m attnlab.compare <name> for one)")
    for name in comparison_names():
        try:
            c = load_comparison(name)
        except ConfigError as exc:
            lines.append(f"  {name:<28} (does not load: {exc})")
            continue
        lines.append(f"  {name:<28} {len(c.models)} models: {', '.join(c.models)}")
        if c.description:
            lines += textwrap.wrap(c.description, 110, initial_indent=" " * 31, subsequent_indent=" " * 31)
    return "\n".join(lines)


def _columns(names: list[str], width: int = 110) -> list[str]:
    lines, line = [], " "
    for name in names:
        if len(line) + len(name) + 2 > width:
            lines.append(line)
            line = " "
        line += f" {name},"
    return [*lines, line.rstrip(",")]


def _describe_one(c: Comparison) -> str:
    seeds = ", ".join(map(str, c.seeds)) if c.seeds else "the config's seed"
    lines = [f"comparison {c.name} ({_shown(c.path)})"]
    lines += textwrap.wrap(c.description, 110, initial_indent="  ", subsequent_indent="  ")
    lines += [f"  seeds: {seeds}", "  models:"]
    for model, (variant, own) in c.models.items():
        flat = _flat(own)
        extra = (" + " + ", ".join(f"{k}={v}" for k, v in flat.items())) if flat else ""
        lines.append(f"    {model:<26} variant={variant}{extra}")
    shared = {k: v for k, v in _flat({k: v for k, v in c.shared.items() if k != "defaults"}).items()}
    groups = [d for d in c.shared.get("defaults", []) if isinstance(d, (dict, str)) and d != "_self_"]
    if groups or shared:
        text = ", ".join([*map(_default_text, groups), *(f"{k}={v}" for k, v in shared.items())])
        lines += textwrap.wrap("shared by every model: " + text, 110, initial_indent="  ", subsequent_indent="    ")
    shipped = c.path.resolve() == (COMPARE_DIR / f"{c.name}.yaml").resolve()
    named = c.name if shipped else _shown(c.path)
    one = f"{c.name}/<model>" if shipped else f"{_shown(c.path)}:<model>"
    lines.append(f"  run it: python train.py -m compare={named}   (its plan: add --dry-run; one model: compare={one})")
    return "\n".join(lines)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it is inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _default_text(entry: Any) -> str:
    if isinstance(entry, dict):
        return ", ".join(f"{k.removeprefix('override ').lstrip('/')}={v}" for k, v in entry.items())
    return str(entry)


def _flat(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}{key}" if not key.startswith("/") else key.lstrip("/")
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnlab.compare [name ...]``: list the named models and comparisons, or describe some."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m attnlab.compare",
        description="The named models (variant=<name>) and comparisons (python train.py -m compare=<name>).",
    )
    parser.add_argument("names", nargs="*", help="comparisons to describe (a name of conf/compare or a file)")
    args = parser.parse_args(argv)
    try:
        register_named_models()
        print(describe(args.names))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # (| head)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
