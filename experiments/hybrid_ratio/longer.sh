#!/usr/bin/env bash
# The hybrid-ratio study's further checks (README), Gated DeltaNet hybrids on MQAR, seed 1, one run each: (a) the
# 1-in-8 rung, which needs 8 layers: G, GGGGGGGS, GGGS and S at 8 layers, matched to the 8-layer GDN-only model's
# parameters (81,072); (b) 4x the steps (2,400) for the none, 3:1 and 1:1 rungs; (c) the grid's edge, 3e-3, for every rung.
# About 10 min on 2 CPU cores.
#   bash experiments/hybrid_ratio/longer.sh             # longer.csv in a new outputs/hybrid_ratio/<date>_<time>_longer/
#   UPDATE=1 bash experiments/hybrid_ratio/longer.sh    # the published experiments/hybrid_ratio/longer.csv
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, PY, DRY_RUN (the seed is fixed: 1).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
SEEDS=1
common="experiment=hybrid_ratio variant=gated_deltanet"
# shellcheck disable=SC2086
sweep layers_8 $common num_layers=8 match.target=81072 model.pattern=G,GGGGGGGS,GGGS,S lr=1e-2
# shellcheck disable=SC2086
sweep steps_2400 $common model.pattern=G,GGGS,GS max_steps=2400 lr=1e-2
# shellcheck disable=SC2086
sweep edge $common model.pattern=G,GGGS,GS,S lr=3e-3
finish longer.csv
