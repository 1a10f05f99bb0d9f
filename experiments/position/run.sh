#!/usr/bin/env bash
# The position study (experiments/position/README.md): Shaw's clip distance, seven position schemes on longer test
# sequences, and MQAR causal against bidirectional over a difficulty ladder, 3 seeds each; then summary.csv and the
# figures.
#   bash experiments/position/run.sh            # about 16 minutes on 2 CPU cores
#   UPDATE=1 bash experiments/position/run.sh   # the same, writing the published summary.csv and figures
# Writes a new folder, outputs/position/<date>_<time>_run/ ($OUT): summary.csv, figure.png, clip.png, mqar.png,
# runs/ (the run folders); UPDATE=1 writes summary.csv and the three figures to experiments/position/.
# Knobs (environment): experiments/lib.sh's OUT, UPDATE, RUNS, SEEDS, PY, DRY_RUN.
source "$(dirname "$0")/../lib.sh"
# 1. Shaw et al. 2018's clip distance k, no absolute positions, bidirectional (so k = 0 is permutation-equivariant)
sweep shaw_clip experiment=position variant=relative_position variant.params.clip=0,1,2,4,16
# 2. Length generalisation: seven schemes under a causal mask, trained on 2..32 tokens, tested at 32, 64, 128
sweep length_absolute experiment=position mask=causal model.pos_encoding=sinusoidal,learned,none
sweep length_relative experiment=position mask=causal variant=rope,relative_position,t5_bias,alibi
# 3. MQAR, causal against bidirectional, over a ladder of 4, 8, 16 pairs (4 tokens per pair)
for pairs in 4 8 16; do
  sweep "mqar_p$pairs" experiment=mqar mask=causal,none task.datamodule.num_pairs=$pairs \
    task.datamodule.seq_len=$((4 * pairs)) results_table=false
done
finish
NAMES=("scaled_dot · sinusoidal:sinusoidal" "scaled_dot · learned:learned" "scaled_dot · none:none (NoPE)"
  "scaled_dot · rope:rope" "relative_position · none:shaw (k=16)" "t5_bias · none:t5" "alibi · none:alibi")
$PY experiments/plot.py "$RESULTS/summary.csv" --where mask=causal task=shift --x length --logx \
  --group variant pos_encoding --rename "${NAMES[@]}" --metrics test/acc --title "Shift, causal: trained on 2..32" \
  -o "$RESULTS/figure.png"
$PY experiments/plot.py "$RESULTS/summary.csv" --where variant=relative_position mask=none \
  --x variant_params.clip --categorical --metrics test/acc test/acc@64 test/acc@128 \
  --title "Shift, bidirectional, Shaw without absolute positions" -o "$RESULTS/clip.png"
$PY experiments/plot.py "$RESULTS/summary.csv" --where task=associative_recall \
  --x task.datamodule.num_pairs --logx --group mask --rename "none:bidirectional (mask=none)" \
  --metrics test/acc train/steps_to_99 --title "MQAR, 1200 steps" -o "$RESULTS/mqar.png"
