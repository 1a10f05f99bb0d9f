#!/usr/bin/env bash
# The stability study (experiments/stability/README.md): 4 attention variants x 7 learning rates x 3 seeds on the
# byte-level LM, then summary.csv, curves.csv (per-layer logit_max and entropy over steps) and the figure.
#   bash experiments/stability/run.sh            # about 11 minutes on 2 CPU cores
#   UPDATE=1 bash experiments/stability/run.sh   # the same, writing the published summary.csv, curves.csv, figure.png
# Writes a new folder, outputs/stability/<date>_<time>_run/ ($OUT): summary.csv, curves.csv, figure.png, runs/ (the
# run folders); UPDATE=1 writes summary.csv, curves.csv and figure.png to experiments/stability/.
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, SEEDS, PY, DRY_RUN.
source "$(dirname "$0")/../lib.sh"
LRS=3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1
sweep plain experiment=stability variant=scaled_dot,cosine lr=$LRS
sweep qk_norm experiment=stability qk_norm=layernorm lr=$LRS
sweep softcap experiment=stability softcap=50 lr=$LRS
finish
$PY experiments/curves.py "$RUNS" -o "$RESULTS/curves.csv" \
  --metrics attn/L0/logit_max attn/L1/logit_max attn/L0/entropy attn/L1/entropy train/loss
$PY experiments/plot.py "$RESULTS/summary.csv" --x lr --logx --group variant qk_norm softcap \
  --rename "scaled_dot · layernorm:qk_norm=layernorm" "scaled_dot · 50:softcap=50" \
  --metrics val/loss attn/logit_max attn/entropy_norm --curves "$RESULTS/curves.csv" --curve-where lr=0.3 \
  --title "Byte-level LM, 200 steps: final loss and attention against the learning rate; below, lr = 0.3 over steps" \
  -o "$RESULTS/figure.png"
