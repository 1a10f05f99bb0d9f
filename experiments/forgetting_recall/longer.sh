#!/usr/bin/env bash
# The forgetting-recall study's "larger budget" check (README): do the decay-only forms close the gap with 3x the
# steps? GLA and RetNet on 3 writes a key, 1,800 steps, seed 1, each at the rate the study's grid chose (1e-2).
# About 4 min on 2 CPU cores.
#   bash experiments/forgetting_recall/longer.sh             # longer.csv in a new outputs/forgetting_recall/<date>_<time>_longer/
#   UPDATE=1 bash experiments/forgetting_recall/longer.sh    # the published experiments/forgetting_recall/longer.csv
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, PY, DRY_RUN (the seed is fixed: 1).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SEEDS=1
sweep decay_longer experiment=forgetting_recall model.short_conv=4 task.datamodule.writes_per_key=3 max_steps=1800 \
  lr=1e-2 variant=gla,retnet
finish longer.csv
