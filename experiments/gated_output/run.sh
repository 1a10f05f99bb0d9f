#!/usr/bin/env bash
# Gated output (issue 47; Qiu et al. 2025, "Gated Attention for Large Language Models"): on the byte-level LM, the
# headwise and elementwise output gates (attention.output_gate) against none, for softmax (scaled_dot) and for Gated
# DeltaNet (with Zoology's short convolution, width 4): bits per byte, the weight on the first token (attn/first_mass,
# the attention sink) and the largest residual activation (attn/act_max). The tuned protocol: lr 3e-3 or 1e-2 by
# val/bpc (lower is better) on seed 0, then seeds 1, 2, 3; 1,000 steps of batch 16 (2 M bytes).
#   bash experiments/gated_output/run.sh             # about 25 min on 2 CPU cores
#   DRY_RUN=1 bash experiments/gated_output/run.sh   # each sweep's --dry-run estimate and their sum; runs nothing
#   UPDATE=1 bash experiments/gated_output/run.sh    # the same, writing the published summary.csv and figure.png
#   python experiments/gated_output/analyze.py       # tables, paired differences, figure.png from the published CSV
# Writes a new folder, outputs/gated_output/<date>_<time>_run/ ($OUT): summary.csv, figure.png (analyze.py on this
# run), runs/ (the run folders); UPDATE=1 writes summary.csv and figure.png to experiments/gated_output/.
# Knobs (environment):
#   GRID=3e-3,1e-2    the learning-rate grid (the metric is fixed: val/bpc, minimised)
#   and experiments/lib.sh's: OUT, UPDATE, RUNS, PY, DRY_RUN, TUNED_SEEDS
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
GRID=${GRID:-3e-3,1e-2}
TUNE_METRIC=val/bpc
TUNE_DIRECTION=minimize
gates="attention.output_gate=null,headwise,elementwise"
tuned softmax experiment=gated_output variant=scaled_dot $gates
tuned gated_deltanet experiment=gated_output variant=gated_deltanet model.short_conv=4 $gates
finish
in_results experiments/gated_output/analyze.py || echo "analyze.py could not read $RESULTS/summary.csv"
