#!/usr/bin/env bash
# The bidirectional-failure evidence of experiments/mqar/README.md: the setting (8 pairs, 32 keys and values,
# the default 4-head encoder, batch 64, lr 3e-3) trained causal and bidirectional for the same 1,000 steps, and
# bidirectional with T5 buckets and with learned positions, then the attention reading and the hand-built solution. Run folders go to ${OUT:-outputs/mqar_bidir}.
set -euo pipefail
OUT=${OUT:-outputs/mqar_bidir}
COMMON=(experiment=mqar task.datamodule.num_pairs=8 task.datamodule.seq_len=null task.datamodule.vocab_keys=32
        task.datamodule.vocab_values=32 num_heads=4 max_steps=1000 eval_every=50)
python train.py "${COMMON[@]}" mask=causal hydra.run.dir="$OUT/causal"
python train.py "${COMMON[@]}" mask=none hydra.run.dir="$OUT/bidirectional"
python train.py "${COMMON[@]}" mask=none variant=t5_bias hydra.run.dir="$OUT/bidirectional_t5"
python train.py "${COMMON[@]}" mask=none model.pos_encoding=learned hydra.run.dir="$OUT/bidirectional_learned"
python experiments/mqar/bidirectional.py "$OUT/causal" "$OUT/bidirectional" "$OUT/bidirectional_t5" \
    "$OUT/bidirectional_learned"
