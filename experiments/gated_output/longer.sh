#!/usr/bin/env bash
# The gated-output study's "larger budget" checks (README), softmax only, seed 1: (a) 4x the steps (4,000, 8 M bytes)
# at the rate the study's grid chose for every configuration (1e-2): does a sink form, and does the gate then lower
# it? (b) the grid's edge: every configuration chose 1e-2, the largest rate of the grid, so 3e-2 at the study's 1,000
# steps. About 11 min on 2 CPU cores.
#   bash experiments/gated_output/longer.sh             # longer.csv in a new outputs/gated_output/<date>_<time>_longer/
#   UPDATE=1 bash experiments/gated_output/longer.sh    # the published experiments/gated_output/longer.csv
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, PY, DRY_RUN (the seed is fixed: 1).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SEEDS=1
gates="attention.output_gate=null,headwise,elementwise"
sweep steps_4000 experiment=gated_output variant=scaled_dot $gates max_steps=4000 lr=1e-2
sweep lr_3e-2 experiment=gated_output variant=scaled_dot $gates lr=3e-2
finish longer.csv
