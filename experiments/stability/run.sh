#!/usr/bin/env bash
# The stability study (experiments/stability/README.md): 4 attention variants x 7 learning rates x 3 seeds on the
# byte-level LM, then summary.csv, curves.csv (per-layer logit_max and entropy over steps) and the figure.
#   bash experiments/stability/run.sh        # about 17 minutes on 2 CPU cores
source "$(dirname "$0")/../lib.sh"
RUNS=${RUNS:-experiments/stability/runs}
LRS=3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1
sweep plain experiment=stability variant=scaled_dot,cosine lr=$LRS
sweep qk_norm experiment=stability qk_norm=layernorm lr=$LRS
sweep softcap experiment=stability softcap=50 lr=$LRS
finish stability
$PY experiments/curves.py "$RUNS" -o experiments/stability/curves.csv \
  --metrics attn/L0/logit_max attn/L1/logit_max attn/L0/entropy attn/L1/entropy train/loss
$PY experiments/plot.py experiments/stability/summary.csv --x lr --logx --group variant qk_norm softcap \
  --rename "scaled_dot · layernorm:qk_norm=layernorm" "scaled_dot · 50:softcap=50" \
  --metrics val/loss attn/logit_max attn/entropy_norm --curves experiments/stability/curves.csv --curve-where lr=0.3 \
  --title "Byte-level LM, 200 steps: final loss and attention against the learning rate; below, lr = 0.3 over steps" \
  -o experiments/stability/figure.png
