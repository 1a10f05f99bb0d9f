"""A self-contained results page (and a terminal table and a CSV) for a run folder, a sweep or a folder of sweeps.

    python -m attnlab.dashboard multirun/2026-11-22/14-03-32_339463     # writes <PATH>/dashboard.html
    attnlab-dashboard multirun/ -o /tmp/all_sweeps.html --x lr --facet none --csv /tmp/runs.csv

It reads only the files every run leaves (``config.yaml``, ``summary.json``, ``metrics.jsonl``, the attention
maps), through :mod:`attnlab.runs`, never a W&B server, and writes ONE HTML file that opens from disk with no
network.

What varies is found, not hard-wired: every config key with two or more values across the runs is a dimension
(:mod:`attnlab.dashboard.dims`); seeds are replicates; a named model (the ``variant=`` choice) is one
configuration, and what its preset sets (``model.short_conv``) is an attribute of it, not a dimension
(``--config-keys`` names the keys that define a configuration instead). The page opens with the headline: the
metric the runs' task declares (``test/acc``, ``test/acc@<longest>`` for a state-tracking task with test lengths;
``--metric`` another), then the runs' ``optimized_metric`` and ``test/acc``: a row per configuration, a column per
value of the main key (``--x``; default the first numeric key a command line swept, e.g. ``d_k``; one column for
a sweep over models), cells "mean ± 95 % CI (n)" with their
runs' parameter count, the best cell of each column starred, and a sentence naming the winner, its margin over the
runner-up and how many of the others it beats: paired t tests over the seeds both ran (Welch's where they share
none), Holm-corrected for the number of comparisons (:mod:`attnlab.dashboard.stats`), with a table of each
rival's paired margin and adjusted p. Then: final metrics against the main key as small multiples (a panel per
value of ``--facet``; points where the key is categorical), a search view when a numeric key took 5 or more values
(an Optuna sweep), length generalisation, the step-0 diagnostics, training curves with seed bands (every
configuration's validation curves on one shared axis first), per layer × head heatmaps and attention maps (best
run of each variant, with a selector), and the sortable runs table. A section with nothing to show is one line.

A tuned sweep (``tuned.json``, :mod:`attnlab.dashboard.tuned`) is compared on its seed runs only, each configuration
at its own best point (in the headline and in every chart of the folder alike), with the protocol said on the page
and its tuning runs drawn as a sensitivity chart; where
summary.json has the compute fields (schema 5), a Pareto view draws the test metric against FLOPs per token,
parameters, state size and wall time, one point per configuration, with the frontier.

Modules: ``load`` (run folders), ``dims`` (what varies), ``metrics`` (how each metric family is drawn),
``stats`` (means, intervals, headline, Pareto frontier), ``tuned`` (tuned sweeps), ``figures`` (plotly figure
dicts), ``page`` (HTML, with ``page.css``, ``page.js`` and ``errors.js``), ``cli``.
"""

from attnlab.dashboard.cli import DEFAULT_OUTPUT, main, print_table, write_csv, write_dashboard
from attnlab.dashboard.dims import Dimension, Sweep
from attnlab.dashboard.load import Run, find_run_dirs, load_run, load_runs
from attnlab.dashboard.metrics import VIEWS, metrics_in, register_metric, show_metric
from attnlab.dashboard.page import Options, build_html
from attnlab.dashboard.stats import Comparison, Headline, Point, Series, aggregate, headline, pareto_front
from attnlab.dashboard.tuned import Tuned, TunedSweep, find_tuned
from attnlab.stats import (
    Difference,
    MetricSpec,
    holm,
    mean_ci,
    paired_difference,
    parse_metric,
    spec_for,
    t_critical,
    welch_difference,
)

__all__ = [
    "DEFAULT_OUTPUT",
    "VIEWS",
    "Comparison",
    "Difference",
    "Dimension",
    "Headline",
    "MetricSpec",
    "Options",
    "Point",
    "Run",
    "Series",
    "Sweep",
    "Tuned",
    "TunedSweep",
    "aggregate",
    "build_html",
    "find_run_dirs",
    "find_tuned",
    "headline",
    "holm",
    "load_run",
    "load_runs",
    "main",
    "mean_ci",
    "metrics_in",
    "paired_difference",
    "pareto_front",
    "parse_metric",
    "print_table",
    "register_metric",
    "show_metric",
    "spec_for",
    "t_critical",
    "welch_difference",
    "write_csv",
    "write_dashboard",
]
