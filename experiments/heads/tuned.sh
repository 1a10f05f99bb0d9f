#!/usr/bin/env bash
# The heads study's rows (A) again with the tuned protocol (experiments/heads/README.md, "Tuned"): each number of
# heads at its own learning rate (1e-3, 3e-3 or 1e-2 by validation bits per byte on seed 0), then on seeds 1, 2, 3.
#   bash experiments/heads/tuned.sh          # about 20 minutes on 2 CPU cores; tuned.csv in a new outputs/heads/<date>_<time>_tuned/
#   UPDATE=1 bash experiments/heads/tuned.sh # the published experiments/heads/tuned.csv
# Knobs (environment): GRID=1e-3,3e-3,1e-2 (the learning-rate grid; the metric is fixed: val/bpc, minimised), and
# experiments/lib.sh's OUT, UPDATE, RUNS, PY, DRY_RUN, TUNED_SEEDS.
source "$(dirname "$0")/../lib.sh"
TUNE_METRIC=val/bpc
TUNE_DIRECTION=minimize
tuned A_tuned experiment=heads num_heads=1,2,4,8,16
finish tuned.csv
