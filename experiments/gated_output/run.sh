#!/usr/bin/env bash
# Gated output (issue 47; Qiu et al. 2025, "Gated Attention for Large Language Models"): on the byte-level LM, the
# headwise and elementwise output gates (attention.output_gate) against none, for softmax (scaled_dot) and for Gated
# DeltaNet (with Zoology's short convolution, width 4): bits per byte, the weight on the first token (attn/first_mass,
# the attention sink) and the largest residual activation (attn/act_max). The tuned protocol: lr 3e-3 or 1e-2 by
# val/bpc (lower is better) on seed 0, then seeds 1, 2, 3; 1,000 steps of batch 16 (2 M bytes).
#   bash experiments/gated_output/run.sh             # about 25 min on 2 CPU cores; summary.csv
#   DRY_RUN=1 bash experiments/gated_output/run.sh   # each sweep's --dry-run estimate and their sum; runs nothing
#   python experiments/gated_output/analyze.py       # tables, paired differences, figure.png from summary.csv
# Run folders go to $RUNS (default outputs/gated_output).
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
RUNS=${RUNS:-outputs/gated_output}
GRID=${GRID:-3e-3,1e-2}
TUNE_METRIC=val/bpc
TUNE_DIRECTION=minimize
gates="attention.output_gate=null,headwise,elementwise"
tuned softmax experiment=gated_output variant=scaled_dot $gates
tuned gated_deltanet experiment=gated_output variant=gated_deltanet model.short_conv=4 $gates
finish gated_output
