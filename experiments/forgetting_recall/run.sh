#!/usr/bin/env bash
# Forgetting MQAR (issue 46): 8 keys, each written once (plain MQAR, the control: nothing to overwrite) or three times
# with a new value (the query wants the newest), at equal state (2 layers, d_model 32, one head: d_model^2 floats a
# layer for every fixed-state form): the delta rule (DeltaNet, Gated DeltaNet, KDA) against decay-only forms (GLA,
# RetNet) and linear attention, with softmax as the reference. Every model with Zoology's short convolution (width 4).
# The tuned protocol: lr from {3e-3, 1e-2, 3e-2} by val/acc_best on seed 0, then seeds 1, 2, 3; 600 steps of batch 64.
#   bash experiments/forgetting_recall/run.sh             # about 32 min on 2 CPU cores
#   DRY_RUN=1 bash experiments/forgetting_recall/run.sh   # each sweep's --dry-run estimate and their sum; runs nothing
#   UPDATE=1 bash experiments/forgetting_recall/run.sh    # the same, writing the published summary.csv and figure.png
#   python experiments/forgetting_recall/analyze.py       # tables, paired differences, figure.png from the published CSV
# Writes a new folder, outputs/forgetting_recall/<date>_<time>_run/ ($OUT): summary.csv, figure.png (analyze.py on
# this run), runs/ (the run folders); UPDATE=1 writes summary.csv and figure.png to experiments/forgetting_recall/.
# Knobs (environment):
#   MODELS="gla kda"       only these models (names of ORDER below; default all seven)
#   GRID=3e-3,1e-2,3e-2    the learning-rate grid
#   and experiments/lib.sh's: OUT, UPDATE, RUNS, PY, DRY_RUN, TUNED_SEEDS, TUNE_METRIC, TUNE_DIRECTION
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
GRID=${GRID:-3e-3,1e-2,3e-2}
common="experiment=forgetting_recall model.short_conv=4 task.datamodule.writes_per_key=1,3"
declare -A MODEL=(
  [softmax]="variant=scaled_dot"
  [linear]="variant=linear"
  [retnet]="variant=retnet"
  [gla]="variant=gla"
  [deltanet]="variant=deltanet"
  [gated_deltanet]="variant=gated_deltanet"
  [kda]="variant=kda"
)
ORDER="softmax linear retnet gla deltanet gated_deltanet kda"
ORDER=${MODELS:-$ORDER}
for m in $ORDER; do
  # shellcheck disable=SC2086
  tuned "recall_$m" $common ${MODEL[$m]}
done
finish
in_results experiments/forgetting_recall/analyze.py || echo "analyze.py could not read $RESULTS/summary.csv"
