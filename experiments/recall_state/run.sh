#!/usr/bin/env bash
# The recall-state trade-off (issue 28): MQAR at three rungs of growing pairs and length, (4, 12), (8, 24) and
# (16, 48) tokens (2 per pair, 1 query per pair: seq_len=null), at two widths (d_model 16 and 32, one head, so the
# per-layer state of a fixed-state form is d_model^2), for softmax, sliding-window softmax, linear attention (elu,
# taylor), Based, RetNet, GLA (scalar and per-channel gate), DeltaNet, Gated DeltaNet, KDA and DeltaProduct (n = 2). Every model has
# Zoology's short convolution (width 4; Based its own 3). Stage 1: each model's learning rate from {3e-3, 1e-2, 3e-2} on the hardest rung at d_model 32,
# seed 0 (best_lr.py: best val/acc_best, then fewest steps to 99 %). Stage 2: each model at its learning rate on
# every rung and width, seeds 0-2: 216 runs. About 90 min on 2 CPU cores. summary.csv, the grid's lr_grid.csv, the
# figures frontier.png and pairs.png (plot.py) and the dashboard are written at the end.
#   bash experiments/recall_state/run.sh                          # into a new outputs/recall_state/<date>_<time>_run/
#   MODELS="kda gla_channel" bash experiments/recall_state/run.sh # only these models, merged with the published rows
#   UPDATE=1 bash experiments/recall_state/run.sh                 # summary.csv, lr_grid.csv, figures to experiments/recall_state/
# Writes a new folder ($OUT): summary.csv, lr_grid.csv, frontier.png, pairs.png, runs/ (stage 2's run folders) and
# runs_grid/ (the grid's); UPDATE=1 writes the CSVs and figures to experiments/recall_state/ (the published ones).
# Knobs (environment):
#   MODELS="kda gla_channel"  run only these models (names of ORDER below); their rows replace theirs in a copy of the
#                             published summary.csv and lr_grid.csv (merge.py; with UPDATE=1, in the published files),
#                             the other models' rows are kept
#   and experiments/lib.sh's: OUT, UPDATE, RUNS, SEEDS (stage 2's; the grid runs on seed 0), PY, DRY_RUN
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
common="experiment=mqar task.datamodule.seq_len=null max_steps=600 diagnostics.enabled=false"
declare -A MODEL=(
  [scaled_dot]="variant=scaled_dot model.short_conv=4"
  [window]="variant=scaled_dot model.pattern=L model.local_window=8 model.short_conv=4"
  [linear_elu]="variant=linear variant.params.feature_map=elu model.short_conv=4"
  [linear_taylor]="variant=linear variant.params.feature_map=taylor model.short_conv=4"
  [based]="variant=based model.local_window=8"
  [retnet]="variant=retnet model.short_conv=4"
  [gla]="variant=gla model.short_conv=4"
  [deltanet]="variant=deltanet model.short_conv=4"
  [gated_deltanet]="variant=gated_deltanet model.short_conv=4"
  [gla_channel]="variant=gla variant.params.gate=channel model.short_conv=4"
  [kda]="variant=kda model.short_conv=4"
  [deltaproduct]="variant=deltaproduct model.short_conv=4"
)
ORDER="scaled_dot window linear_elu linear_taylor based retnet gla deltanet gated_deltanet gla_channel kda deltaproduct"
ORDER=${MODELS:-$ORDER}
if [ -n "${MODELS:-}" ] && [ "$UPDATE" != 1 ] && [ "$PY" != ":" ] && [ "$DRY_RUN" != 1 ]; then
  cp "$PUBLISHED/summary.csv" "$PUBLISHED/lr_grid.csv" "$RESULTS/"  # the published rows, merged with the new (a copy)
fi

# stage 1: the learning-rate grid (one seed, the hardest rung, d_model 32), into ${RUNS}_grid (not in summary.csv)
for m in $ORDER; do
  # shellcheck disable=SC2086
  RUNS="${RUNS}_grid" SEEDS=0 sweep "grid_$m" $common ${MODEL[$m]} task.datamodule.num_pairs=16 d_model=32 \
    lr=3e-3,1e-2,3e-2
done
if [ "$PY" != ":" ] && [ "$DRY_RUN" != 1 ]; then  # (a dry run has no grid to read: stage 2 is planned at 3e-3)
  grids=()
  for m in $ORDER; do grids+=("${RUNS}_grid/grid_$m"); done
  # (best_lr.py writes lr_grid.csv beside itself: in_results makes that $RESULTS)
  eval "$(in_results experiments/recall_state/best_lr.py ${MODELS:+--merge} "${grids[@]}")"
fi

# stage 2: every rung and width at the chosen learning rate, three seeds
for m in $ORDER; do
  lr_var="LR_$m"
  # shellcheck disable=SC2086
  sweep "$m" $common ${MODEL[$m]} task.datamodule.num_pairs=4,8,16 d_model=16,32 lr="${!lr_var:-3e-3}"
done
if [ -n "${MODELS:-}" ]; then  # only some models: their rows into summary.csv, the others' kept
  finish summary.new.csv
  # shellcheck disable=SC2086
  in_results experiments/recall_state/merge.py "$RESULTS/summary.new.csv" $ORDER
else
  finish  # stage 2's runs; the grid's are in lr_grid.csv
fi
in_results experiments/recall_state/plot.py || echo "plot.py could not draw from $RESULTS/summary.csv"
