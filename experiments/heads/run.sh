#!/usr/bin/env bash
# The heads study (experiments/heads/README.md): num_heads x d_k at num_heads * d_k = 64, d_k alone at 4 heads, and
# grouped KV heads at 8 heads, 3 seeds each, on the byte-level LM; then summary.csv and the figure.
#   bash experiments/heads/run.sh            # about 12 minutes on 2 CPU cores
#   UPDATE=1 bash experiments/heads/run.sh   # the same, writing the published summary.csv and figures
# Writes a new folder, outputs/heads/<date>_<time>_run/ ($OUT): summary.csv, figure.png, dk.png, gqa.png, runs/ (the
# run folders); UPDATE=1 writes summary.csv and the three figures to experiments/heads/.
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, SEEDS, PY, DRY_RUN.
source "$(dirname "$0")/../lib.sh"
sweep A_heads experiment=heads num_heads=1,2,4,8,16
sweep B_dk experiment=heads num_heads=4 d_k=8,4 model.d_v=16
sweep C_gqa experiment=heads num_heads=8 num_kv_heads=1,2,4
finish
$PY experiments/plot.py "$RESULTS/summary.csv" --where "run=A_heads/*" --x num_heads --logx --group task \
  --rename "text:num_heads x d_k = 64" --metrics test/bpc test/acc --title "(A) heads at a fixed width" \
  -o "$RESULTS/figure.png"
$PY experiments/plot.py "$RESULTS/summary.csv" --where "run=A_heads/*,B_dk/*" num_heads=4 --x d_k --logx \
  --group task --rename "text:4 heads, d_v = 16" --metrics test/bpc test/acc --title "(B) the key size alone" \
  -o "$RESULTS/dk.png"
$PY experiments/plot.py "$RESULTS/summary.csv" --where "run=A_heads/*,C_gqa/*" num_heads=8 --x num_kv_heads \
  --logx --group task --rename "text:8 heads, d_k = 8" --metrics test/bpc test/acc params \
  --title "(C) grouped key/value heads" -o "$RESULTS/gqa.png"
