#!/usr/bin/env bash
# Learning-rate window (issue 47; Okpekpe & Orvieto 2025, "Revisiting associative recall in modern recurrent models"):
# MQAR (8 pairs in 32 tokens), 2 layers, d_model 32, one head, short convolution of width 4, 300 steps of batch 64,
# softmax against linear attention, GLA, Gated DeltaNet and KDA, each at every learning rate of the grid
# 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 3e-2 and on seeds 0-3. Seed 0 is the tuning seed (it chooses each model's
# best learning rate, as hydra/sweeper=tuned would); seeds 1-3 give the curves, their intervals and the comparisons.
#   bash experiments/lr_window/run.sh             # about 26 min on 2 CPU cores
#   DRY_RUN=1 bash experiments/lr_window/run.sh   # each sweep's --dry-run estimate and their sum; runs nothing
#   UPDATE=1 bash experiments/lr_window/run.sh    # the same, writing the published summary.csv and figure.png
#   python experiments/lr_window/analyze.py       # tables, paired differences, figure.png from the published CSV
# Writes a new folder, outputs/lr_window/<date>_<time>_run/ ($OUT): summary.csv, figure.png (analyze.py on this
# run), runs/ (the run folders); UPDATE=1 writes summary.csv and figure.png to experiments/lr_window/.
# Knobs (environment):
#   MODELS="gla kda"                           only these models (default: scaled_dot linear gla gated_deltanet kda)
#   LRS=1e-4,2e-4,5e-4,1e-3,2e-3,5e-3,1e-2,3e-2  the learning rates, every one run on every seed
#   SEEDS=0,1,2,3                              the seeds (0 chooses each model's best rate)
#   and experiments/lib.sh's: OUT, UPDATE, RUNS, PY, DRY_RUN
SEEDS=${SEEDS:-0,1,2,3}  # (before lib.sh, whose default is 0,1,2)
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
LRS=${LRS:-1e-4,2e-4,5e-4,1e-3,2e-3,5e-3,1e-2,3e-2}
ORDER=${MODELS:-scaled_dot linear gla gated_deltanet kda}
for v in $ORDER; do
  sweep "$v" experiment=lr_window variant="$v" lr="$LRS"
done
finish
in_results experiments/lr_window/analyze.py || echo "analyze.py could not read $RESULTS/summary.csv"
