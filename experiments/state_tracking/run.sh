#!/usr/bin/env bash
# State tracking (issue 46; Merrill et al. 2024, Grazzi et al. 2025, Siems et al. 2025): parity and mod-3 counting for
# eleven forms (softmax with sinusoidal positions and without any, linear, GLA, DeltaNet and Gated DeltaNet with
# beta in (0, 1) and in (0, 2), DeltaProduct n_h = 2, RWKV-7, KDA) at 2 layers, trained on 32 tokens and tested on 64
# and 128 (only the positions beyond 32 scored); then S3 at ONE layer for the delta rule with one Householder step a
# token (DeltaNet, Gated DeltaNet, beta in (0, 2)) against two and three (DeltaProduct). Every model: the tuned protocol
# (lr 3e-3 or 1e-2 by val/acc_best on seed 0, then seeds 1, 2, 3), 300 steps of batch 64.
#   bash experiments/state_tracking/run.sh             # about 31 min on 2 CPU cores
#   DRY_RUN=1 bash experiments/state_tracking/run.sh   # each sweep's --dry-run estimate and their sum; runs nothing
#   UPDATE=1 bash experiments/state_tracking/run.sh    # the same, writing the published summary.csv and figure.png
#   python experiments/state_tracking/analyze.py       # tables, paired differences, figure.png from the published CSV
# Writes a new folder, outputs/state_tracking/<date>_<time>_run/ ($OUT): summary.csv, figure.png (analyze.py on this
# run), runs/ (the run folders); UPDATE=1 writes summary.csv and figure.png to experiments/state_tracking/.
# Knobs (environment):
#   MODELS="deltanet kda"   only these models' parity and mod-3 sweeps (names of ORDER below), and no S3 sweeps
#   GRID=3e-3,1e-2          the learning-rate grid
#   and experiments/lib.sh's: OUT, UPDATE, RUNS, PY, DRY_RUN, TUNED_SEEDS, TUNE_METRIC, TUNE_DIRECTION
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
GRID=${GRID:-3e-3,1e-2}
common="experiment=state_tracking"
rec="model.pos_encoding=none model.short_conv=4"  # the recurrent forms: no position encoding (their order is their own)
declare -A MODEL=(
  [softmax]="variant=scaled_dot model.short_conv=4"
  [softmax_nope]="variant=scaled_dot model.pos_encoding=none model.short_conv=4"
  [linear]="variant=linear $rec"
  [gla]="variant=gla $rec"
  [deltanet]="variant=deltanet $rec"
  [deltanet_neg]="variant=deltanet variant.params.beta_range=2 $rec"
  [gated_deltanet]="variant=gated_deltanet $rec"
  [gated_deltanet_neg]="variant=gated_deltanet variant.params.beta_range=2 $rec"
  [deltaproduct]="variant=deltaproduct variant.params.beta_range=2 $rec"
  [rwkv7]="variant=rwkv7 model.pos_encoding=none"
  [kda]="variant=kda $rec"
)
ORDER="softmax softmax_nope linear gla deltanet deltanet_neg gated_deltanet gated_deltanet_neg deltaproduct rwkv7 kda"
ORDER=${MODELS:-$ORDER}

# parity and mod-3 counting, 2 layers, every model
for m in $ORDER; do
  # shellcheck disable=SC2086
  tuned "counting_$m" $common ${MODEL[$m]} task=parity,modular
done
# S3 at one layer: one Householder step a token (beta in (0, 2)) against two and three
if [ -z "${MODELS:-}" ]; then
  s3="$common task=permutation task.datamodule.group=S3 num_layers=1 $rec"
  for v in deltanet gated_deltanet; do  # one sweep each: a non-swept variant.params key must exist in the sweep's config
    # shellcheck disable=SC2086
    tuned "s3_$v" $s3 variant=$v variant.params.beta_range=2
  done
  # shellcheck disable=SC2086
  tuned s3_product $s3 variant=deltaproduct variant.params.beta_range=2 variant.params.householder_steps=2,3
fi
finish
in_results experiments/state_tracking/analyze.py || echo "analyze.py could not read $RESULTS/summary.csv"
