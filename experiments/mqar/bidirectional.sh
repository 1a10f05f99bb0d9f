#!/usr/bin/env bash
# The bidirectional-failure evidence of experiments/mqar/README.md: the issue's setting (8 pairs, 32 keys and values,
# the default 4-head encoder, batch 64, lr 3e-3) trained causal and bidirectional for the same 1,000 steps, and
# bidirectional with T5 buckets and with learned positions, then the attention reading and the hand-built solution.
#   bash experiments/mqar/bidirectional.sh   # run folders in a new outputs/mqar/<date>_<time>_bidirectional/runs/
# It prints its evidence and writes no published file (UPDATE changes nothing here; DRY_RUN is not read).
# Knobs (environment): experiments/lib.sh's OUT, RUNS, PY.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
COMMON=(experiment=mqar task.datamodule.num_pairs=8 task.datamodule.seq_len=null task.datamodule.vocab_keys=32
        task.datamodule.vocab_values=32 num_heads=4 max_steps=1000 eval_every=50)
$PY train.py "${COMMON[@]}" mask=causal hydra.run.dir="$RUNS/causal"
$PY train.py "${COMMON[@]}" mask=none hydra.run.dir="$RUNS/bidirectional"
$PY train.py "${COMMON[@]}" mask=none variant=t5_bias hydra.run.dir="$RUNS/bidirectional_t5"
$PY train.py "${COMMON[@]}" mask=none model.pos_encoding=learned hydra.run.dir="$RUNS/bidirectional_learned"
$PY experiments/mqar/bidirectional.py "$RUNS/causal" "$RUNS/bidirectional" "$RUNS/bidirectional_t5" \
    "$RUNS/bidirectional_learned"
