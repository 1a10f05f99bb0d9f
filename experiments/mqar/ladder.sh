#!/usr/bin/env bash
# The MQAR difficulty ladder of experiments/mqar/README.md: pairs 6, 12, 24, 48 in sequences of 4 tokens per pair
# (seq_len 24, 48, 96, 192; 48 keys and values), each attention variant of the variant space trained for the same steps, one seed.
# Run folders go to ${OUT:-outputs/mqar_ladder}; the table is printed at the end.
set -euo pipefail
OUT=${OUT:-outputs/mqar_ladder}
SEEDS=${SEEDS:-0}
declare -A VARIANTS=(
  [scaled_dot]="variant=scaled_dot"
  [rope]="variant=rope"
  [alibi]="variant=alibi"
  [qk_rmsnorm]="qk_norm=rmsnorm"
  [sigmoid]="normalizer=sigmoid"
  [diff]="variant=diff"
)
for pairs in ${PAIRS:-6 12 24 48}; do
  for name in scaled_dot rope alibi qk_rmsnorm sigmoid diff; do
    # shellcheck disable=SC2086
    python train.py -m experiment=mqar task.datamodule.num_pairs=$pairs task.datamodule.seq_len=$((4 * pairs)) \
        ${VARIANTS[$name]} seed="$SEEDS" hydra.sweep.dir="$OUT/p$pairs/$name"
  done
done
python experiments/mqar/summarize.py "$OUT" --csv experiments/mqar/ladder.csv
