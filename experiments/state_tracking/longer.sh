#!/usr/bin/env bash
# The state-tracking study's "larger budget" check (README, "What a larger budget would change"): the cells the study
# left unsolved, again at 5x the steps (1,500), one seed (1), each at the rate the study's grid chose for it: softmax on
# parity (does it learn the training length, and then generalise?), DeltaNet beta in (0, 2) on mod 3, and S3 and S5 at
# one layer with 1, 2 (and for S5 4) Householder steps a token. About 8 min on 2 CPU cores.
#   bash experiments/state_tracking/longer.sh            # longer.csv in a new outputs/state_tracking/<date>_<time>_longer/
#   UPDATE=1 bash experiments/state_tracking/longer.sh   # the published experiments/state_tracking/longer.csv
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, PY, DRY_RUN (the seed is fixed: 1).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SEEDS=1
common="experiment=state_tracking max_steps=1500"
rec="model.pos_encoding=none model.short_conv=4"
sweep softmax_parity $common task=parity variant=scaled_dot model.short_conv=4 lr=1e-2
sweep deltanet_mod3 $common task=modular variant=deltanet variant.params.beta_range=2 $rec lr=1e-2
one="$common task=permutation num_layers=1 $rec lr=1e-2 variant=deltaproduct variant.params.beta_range=2"
sweep s3_steps $one task.datamodule.group=S3 variant.params.householder_steps=1,2
sweep s5_steps $one task.datamodule.group=S5 variant.params.householder_steps=1,4
finish longer.csv
