#!/usr/bin/env bash
# Pruning heads at test time (issue 30; Michel et al. 2019): softmax (scaled_dot), linear attention (elu) and GLA on
# the byte-level LM with 2 layers of 8 heads (experiment=pruning), seeds 0-2: 9 runs, each ending with head importance
# on the validation set and the test bits per byte as heads are removed by importance and in 3 random orders
# (pruning.json); about 7 min on 2 CPU cores. summary.csv, curves.csv and figure.png (analyze.py) are written at the
# end.
#   bash experiments/pruning/run.sh             # into a new outputs/pruning/<date>_<time>_run/ ($OUT; runs/ in it)
#   UPDATE=1 bash experiments/pruning/run.sh    # summary.csv, curves.csv, figure.png to experiments/pruning/
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, SEEDS, PY, DRY_RUN.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
sweep text experiment=pruning variant=scaled_dot,linear,gla threads=1
runtime
if [ "$PY" != ":" ]; then
  $PY experiments/pruning/analyze.py "$RUNS" "$RESULTS"
fi
