#!/usr/bin/env bash
# Hybrid ratio (issue 47; Wang et al. 2025, "A Systematic Analysis of Hybrid Linear Attention"): 4 layers of Gated
# DeltaNet with one softmax layer every 1, 2 and 4 layers (patterns S, GS, GGGS) and none (G), every model at the
# GDN-only model's parameter count (match.by=params on d_ff), on MQAR with 12 pairs (a linear layer's state, d_k = 8,
# holds 8 keys) and on compositional MQAR (4 x 3 two-part keys); then GLA and KDA alone (G) and in the 3:1 hybrid
# (GGGS) on MQAR, for the standalone-vs-hybrid ranking. The tuned protocol: lr 1e-2 or 3e-2 by val/acc_best on seed
# 0, then seeds 1, 2, 3; 600 steps of batch 64. The 1-in-8 rung needs 8 layers: longer.sh.
#   bash experiments/hybrid_ratio/run.sh             # about 30 min on 2 CPU cores
#   DRY_RUN=1 bash experiments/hybrid_ratio/run.sh   # each sweep's --dry-run estimate and their sum; runs nothing
#   UPDATE=1 bash experiments/hybrid_ratio/run.sh    # the same, writing the published summary.csv and figure.png
#   python experiments/hybrid_ratio/analyze.py       # tables, paired differences, figure.png from the published CSV
# Writes a new folder, outputs/hybrid_ratio/<date>_<time>_run/ ($OUT): summary.csv, figure.png (analyze.py on this
# run), runs/ (the run folders); UPDATE=1 writes summary.csv and figure.png to experiments/hybrid_ratio/.
# Knobs (environment):
#   GRID=1e-2,3e-2    the learning-rate grid
#   and experiments/lib.sh's: OUT, UPDATE, RUNS, PY, DRY_RUN, TUNED_SEEDS, TUNE_METRIC, TUNE_DIRECTION
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
GRID=${GRID:-1e-2,3e-2}
common="experiment=hybrid_ratio"
ratios="model.pattern=S,GS,GGGS,G"
comp="task=compositional_recall ~task.datamodule.num_pairs ~task.datamodule.vocab_keys task.datamodule.rows=4 task.datamodule.cols=3 task.datamodule.num_val=500"
# shellcheck disable=SC2086
tuned mqar_gated_deltanet $common variant=gated_deltanet $ratios
# shellcheck disable=SC2086
tuned comp_gated_deltanet $common variant=gated_deltanet $ratios $comp
for v in gla kda; do  # standalone and 3:1 hybrid (GDN's two are in the first sweep)
  # shellcheck disable=SC2086
  tuned "mqar_$v" $common variant=$v model.pattern=G,GGGS
done
finish
in_results experiments/hybrid_ratio/analyze.py || echo "analyze.py could not read $RESULTS/summary.csv"
