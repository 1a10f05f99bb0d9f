#!/usr/bin/env bash
# The normalizer study's MQAR half again with the tuned protocol (experiments/normalizers/README.md, "Tuned"):
# softmax, sigmoid and softpick each at its own learning rate (1e-3, 3e-3 or 1e-2 by val/acc_best on seed 0), then on
# seeds 1, 2, 3.
#   bash experiments/normalizers/tuned.sh    # about 10 minutes on 2 CPU cores; tuned.csv in a new outputs/normalizers/<date>_<time>_tuned/
#   UPDATE=1 bash experiments/normalizers/tuned.sh   # the published experiments/normalizers/tuned.csv
# Knobs (environment): GRID=1e-3,3e-3,1e-2 (the learning-rate grid), and experiments/lib.sh's OUT, UPDATE, RUNS, PY,
# DRY_RUN, TUNED_SEEDS, TUNE_METRIC, TUNE_DIRECTION.
source "$(dirname "$0")/../lib.sh"
tuned mqar_tuned experiment=normalizers normalizer=softmax,sigmoid,softpick
finish tuned.csv
