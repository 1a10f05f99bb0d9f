#!/usr/bin/env bash
# The normalizer study (experiments/normalizers/README.md): 7 normalizers x 3 seeds on MQAR (8 pairs, causal) and on
# Sort (bidirectional), then summary.csv and the figure.
#   bash experiments/normalizers/run.sh      # about 15 minutes on 2 CPU cores
source "$(dirname "$0")/../lib.sh"
RUNS=${RUNS:-experiments/normalizers/runs}
NORMALIZERS=softmax,softmax1,sink,sigmoid,sparsemax,entmax15,softpick
sweep mqar experiment=normalizers normalizer=$NORMALIZERS
sweep sort experiment=position task=sort 'task.datamodule.test_lengths=null' normalizer=$NORMALIZERS
finish normalizers
$PY experiments/plot.py experiments/normalizers/summary.csv --x normalizer --group task \
  --rename "associative_recall:MQAR (8 pairs, causal)" "sort:Sort (bidirectional)" \
  --metrics test/acc attn/row_mass attn/support attn/entropy_norm attn/first_mass -o experiments/normalizers/figure.png
