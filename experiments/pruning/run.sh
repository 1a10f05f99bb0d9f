#!/usr/bin/env bash
# Pruning heads at test time (issue 30; Michel et al. 2019): softmax (scaled_dot), linear attention (elu) and GLA on
# the byte-level LM with 2 layers of 8 heads (experiment=pruning), seeds 0-2: 9 runs, each ending with head importance
# on the validation set and the test bits per byte as heads are removed by importance and in 3 random orders
# (pruning.json); about 6 min on 2 CPU cores. Run folders go to $RUNS (default outputs/pruning); summary.csv,
# curves.csv and figure.png (analyze.py) are written at the end.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
RUNS=${RUNS:-outputs/pruning}
sweep text experiment=pruning variant=scaled_dot,linear,gla threads=1
echo "runtime: $(($(date +%s) - START)) s"
if [ "$PY" != ":" ]; then
  $PY experiments/pruning/analyze.py "$RUNS" experiments/pruning
fi
