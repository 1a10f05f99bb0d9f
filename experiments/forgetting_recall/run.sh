#!/usr/bin/env bash
# Forgetting MQAR (issue 46): 8 keys, each written once (plain MQAR, the control: nothing to overwrite) or three times
# with a new value (the query wants the newest), at equal state (2 layers, d_model 32, one head: d_model^2 floats a
# layer for every fixed-state form): the delta rule (DeltaNet, Gated DeltaNet, KDA) against decay-only forms (GLA,
# RetNet) and linear attention, with softmax as the reference. Every model with Zoology's short convolution (width 4).
# The tuned protocol: lr from {3e-3, 1e-2, 3e-2} by val/acc_best on seed 0, then seeds 1, 2, 3; 600 steps of batch 64.
#   bash experiments/forgetting_recall/run.sh             # about 25 min on 2 CPU cores; summary.csv
#   DRY_RUN=1 bash experiments/forgetting_recall/run.sh   # each sweep's --dry-run estimate and their sum; runs nothing
#   python experiments/forgetting_recall/analyze.py       # tables, paired differences, figure.png from summary.csv
# Run folders go to $RUNS (default outputs/forgetting_recall).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
RUNS=${RUNS:-outputs/forgetting_recall}
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
finish forgetting_recall
