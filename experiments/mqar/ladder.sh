#!/usr/bin/env bash
# The MQAR difficulty ladder of experiments/mqar/README.md: pairs 6, 12, 24, 48 in sequences of 4 tokens per pair
# (seq_len 24, 48, 96, 192; 48 keys and values), each attention variant of the variant space trained for the same steps, one seed.
#   bash experiments/mqar/ladder.sh                     # ladder.csv in a new outputs/mqar/<date>_<time>_ladder/ ($OUT)
#   PAIRS="6 12 24" bash experiments/mqar/ladder.sh     # only these rungs
#   UPDATE=1 bash experiments/mqar/ladder.sh            # the published experiments/mqar/ladder.csv
# The table is printed at the end. Knobs (environment):
#   PAIRS="6 12 24 48"   the rungs (pairs)
#   SEEDS=0              the seeds of each sweep
#   and experiments/lib.sh's: OUT, UPDATE, RUNS, PY (DRY_RUN is not read)
SEEDS=${SEEDS:-0}  # (before lib.sh, whose default is 0,1,2)
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
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
    $PY train.py -m experiment=mqar task.datamodule.num_pairs=$pairs task.datamodule.seq_len=$((4 * pairs)) \
        ${VARIANTS[$name]} seed="$SEEDS" hydra.sweep.dir="$RUNS/p$pairs/$name"
  done
done
$PY experiments/mqar/summarize.py "$RUNS" --csv "$RESULTS/ladder.csv"
