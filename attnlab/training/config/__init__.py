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

One concern per module (each imports only those above it in this list):

* :mod:`~attnlab.training.config.base`: :data:`CONF_DIR`, the config groups, :class:`ConfigError` and the small
  helpers every part shares.
* :mod:`~attnlab.training.config.compose`: Hydra composition (the checks of the command line before it, the
  resolvers, the user's ``imports``, composing with another variant) and what a config builds: each layer's
  attention config, the module, ``d_k``, the threads.
* :mod:`~attnlab.training.config.budgets`: ``max_tokens`` → ``max_steps``, ``match`` (parameter and state counts),
  and whether a run fits in memory.
* :mod:`~attnlab.training.config.validate`: :func:`validate_config` and its checks, one per part of the config.
* :mod:`~attnlab.training.config.resume`: what a resume may change (:func:`config_changes`).

Every name that other code imported from the single module this package was is re-exported here; a private helper
lives in its part only (a test that patches one patches it there, where it is looked up).
"""

from attnlab.training.config.base import (
    CONF_DIR,
    CUSTOM_GROUPS,
    GROUPS,
    MAX_STEPS,
    ConfigError,
    plain,
)
from attnlab.training.config.budgets import (
    MATCH_BY,
    MATCH_KEYS,
    MATCH_MAX_WIDTH,
    match_count,
    resolve_match,
    resolve_max_tokens,
)
from attnlab.training.config.compose import (
    ATTENTION_TARGET,
    attention_configs,
    base_attention,
    build_module,
    check_group_choices,
    check_override_text,
    group_choices,
    import_user_modules,
    job_dir_name,
    resolve_d_k,
    rope_setting,
    set_threads,
)
from attnlab.training.config.resume import (
    EXTENSION_KEYS,
    attention_sources,
    config_changes,
    config_defaults,
    flatten_config,
    is_neutral,
)
from attnlab.training.config.validate import (
    MAX_PRUNE_POINTS,
    MAX_RANDOM_ORDERS,
    MAX_THREADS_PER_CORE,
    TRAINER_KEYS,
    TRAINER_PRECISIONS,
    check_resolves,
    validate_config,
)

__all__ = [
    "ATTENTION_TARGET",
    "CONF_DIR",
    "CUSTOM_GROUPS",
    "EXTENSION_KEYS",
    "GROUPS",
    "MATCH_BY",
    "MATCH_KEYS",
    "MATCH_MAX_WIDTH",
    "MAX_PRUNE_POINTS",
    "MAX_RANDOM_ORDERS",
    "MAX_STEPS",
    "MAX_THREADS_PER_CORE",
    "TRAINER_KEYS",
    "TRAINER_PRECISIONS",
    "ConfigError",
    "attention_configs",
    "attention_sources",
    "base_attention",
    "build_module",
    "check_group_choices",
    "check_override_text",
    "check_resolves",
    "config_changes",
    "config_defaults",
    "flatten_config",
    "group_choices",
    "import_user_modules",
    "is_neutral",
    "job_dir_name",
    "match_count",
    "plain",
    "resolve_d_k",
    "resolve_match",
    "resolve_max_tokens",
    "rope_setting",
    "set_threads",
    "validate_config",
]
