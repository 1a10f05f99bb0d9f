#!/usr/bin/env bash
# Softmax against linear attention on MQAR (issue 27): scaled_dot (softmax) and variant=linear with the elu, taylor
# (Based's map) and performer feature maps, at 12 pairs in 48 tokens (experiment=mqar's default) and 16 pairs in 64
# tokens, seeds 0-2, 1,200 steps each (experiment=mqar: 2 layers, d_model 64, 1 head, causal); each without and with
# a short convolution of width 4 on q, k and v (model.short_conv=4, as Zoology and Based give every mixer).
# About 75 min on 2 CPU cores. summary.csv and the dashboard are written at the end (experiments/lib.sh's finish).
#   bash experiments/linear_mqar/run.sh            # into a new outputs/linear_mqar/<date>_<time>_run/ ($OUT; runs/ in it)
#   UPDATE=1 bash experiments/linear_mqar/run.sh   # summary.csv to experiments/linear_mqar/ (the published one)
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, SEEDS, PY, DRY_RUN.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
for pairs in 12 16; do
  data="task.datamodule.num_pairs=$pairs task.datamodule.seq_len=$((4 * pairs))"
  # shellcheck disable=SC2086
  sweep "p${pairs}_softmax" experiment=mqar $data variant=scaled_dot model.short_conv=null,4
  # shellcheck disable=SC2086
  sweep "p${pairs}_linear" experiment=mqar $data variant=linear variant.params.feature_map=elu,taylor,performer \
    model.short_conv=null,4
done
finish
