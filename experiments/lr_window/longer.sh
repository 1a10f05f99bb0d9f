#!/usr/bin/env bash
# The learning-rate-window study's further checks (README), seed 1: (a) beyond the grid's top: every model solved
# MQAR at 3e-2, the grid's largest rate, so 1e-1; (b) without the short convolution (model.short_conv=null), softmax
# and Gated DeltaNet over the whole grid; (c) 5x the steps (1,500) at 1e-3 and 2e-3, where no model solved the task
# in 300, for softmax and Gated DeltaNet. About 6 min on 2 CPU cores.
#   bash experiments/lr_window/longer.sh             # longer.csv in a new outputs/lr_window/<date>_<time>_longer/
#   UPDATE=1 bash experiments/lr_window/longer.sh    # the published experiments/lr_window/longer.csv
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, PY, DRY_RUN (the seed is fixed: 1).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SEEDS=1
sweep edge experiment=lr_window variant=scaled_dot,linear,gla,gated_deltanet,kda lr=1e-1
sweep no_conv experiment=lr_window variant=scaled_dot,gated_deltanet model.short_conv=null \
  lr=1e-4,2e-4,5e-4,1e-3,2e-3,5e-3,1e-2,3e-2
sweep steps_1500 experiment=lr_window variant=scaled_dot,gated_deltanet lr=1e-3,2e-3 max_steps=1500
finish longer.csv
