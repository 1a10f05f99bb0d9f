#!/usr/bin/env bash
# The normalizer study (experiments/normalizers/README.md): 7 normalizers x 3 seeds on MQAR (8 pairs, causal) and on
# Sort (bidirectional), then summary.csv and the figure.
#   bash experiments/normalizers/run.sh            # about 13 minutes on 2 CPU cores
#   UPDATE=1 bash experiments/normalizers/run.sh   # the same, writing the published summary.csv and figure.png
# Writes a new folder, outputs/normalizers/<date>_<time>_run/ ($OUT): summary.csv, figure.png, runs/ (the run
# folders); UPDATE=1 writes summary.csv and figure.png to experiments/normalizers/.
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, SEEDS, PY, DRY_RUN.
source "$(dirname "$0")/../lib.sh"
NORMALIZERS=softmax,softmax1,sink,sigmoid,sparsemax,entmax15,softpick
sweep mqar experiment=normalizers normalizer=$NORMALIZERS
sweep sort experiment=position task=sort 'task.datamodule.test_lengths=null' normalizer=$NORMALIZERS
finish
$PY experiments/plot.py "$RESULTS/summary.csv" --x normalizer --group task \
  --rename "associative_recall:MQAR (8 pairs, causal)" "sort:Sort (bidirectional)" \
  --metrics test/acc attn/row_mass attn/support attn/entropy_norm attn/first_mass -o "$RESULTS/figure.png"
