#!/usr/bin/env bash
# Induction heads and the phase change (issue 30; Olsson et al. 2022): softmax (scaled_dot), linear attention (elu)
# and GLA (a decay form), one layer against two, seeds 0-2, on MQAR (experiment=induction: 800 steps, diagnostics and
# validation every 25) and on the byte-level LM (experiment=induction_text: 1,000 steps, every 50): 36 runs, about
# 11 min on 2 CPU cores. summary.csv (one row per run, with the steps at which the induction score and the accuracy
# jump: analyze.py), curves.csv and figure.png are written at the end.
#   bash experiments/induction/run.sh              # into a new outputs/induction/<date>_<time>_run/ ($OUT; runs/ in it)
#   UPDATE=1 bash experiments/induction/run.sh     # summary.csv, curves.csv, figure.png to experiments/induction/
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, SEEDS, PY, DRY_RUN.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
sweep mqar experiment=induction variant=scaled_dot,linear,gla num_layers=1,2 threads=1
sweep text experiment=induction_text variant=scaled_dot,linear,gla num_layers=1,2 threads=1
runtime
if [ "$PY" != ":" ]; then
  $PY experiments/curves.py "$RUNS" -o "$RESULTS/curves.csv" \
    --metrics attn/induction_max attn/prev_token_max val/acc val/loss
  $PY experiments/induction/analyze.py "$RUNS" "$RESULTS"
fi
