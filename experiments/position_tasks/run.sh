#!/usr/bin/env bash
# Shift / Reverse / Sort under seven position schemes: one short run each (one seed), sequential, one thread.
#   bash experiments/position_tasks/run.sh [max_steps]   # default 1000; run folders in a new outputs/position_tasks/<date>_<time>_run/runs/
#   OUT=outputs/position_tasks/<an earlier run> bash experiments/position_tasks/run.sh   # continues it: finished runs are skipped
# Prints the test-accuracy table (test/acc: padded lengths 1..32 as in training; test/acc@32 and @64: sequences of
# exactly 32 and 64 tokens, the latter longer than any training sequence). It writes no published file (UPDATE
# changes nothing here; DRY_RUN is not read).
# Knobs (environment): experiments/lib.sh's OUT, RUNS, PY; the steps are the first argument.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
STEPS=${1:-1000}
mkdir -p "$RUNS"
declare -A SCHEME=(
  [sinusoidal]=""
  [learned]="model.pos_encoding=learned"
  [none]="model.pos_encoding=none"
  [rope]="variant=rope"
  [shaw]="variant=relative_position"
  [t5]="variant=t5_bias"
  [alibi]="variant=alibi"
)
ORDER="sinusoidal learned none rope shaw t5 alibi"
for task in shift reverse sort; do
  for scheme in $ORDER; do
    dir="$RUNS/${task}_${scheme}"
    [ -f "$dir/summary.json" ] && { echo "skip $dir (done)"; continue; }
    # shellcheck disable=SC2086
    $PY train.py task=$task ${SCHEME[$scheme]} logger=none diagnostics.enabled=false results_table=false threads=1 \
      max_steps="$STEPS" batch_size=32 lr=3e-3 eval_every=$((STEPS / 4)) \
      'task.datamodule.test_lengths=[32,64]' hydra.run.dir="$dir" overwrite=true > "$dir.log" 2>&1 \
      || { echo "FAILED: $task $scheme (see $dir.log)"; continue; }
    echo "done $task $scheme"
  done
done
$PY - "$RUNS" $ORDER <<'PY'
import json, sys
from pathlib import Path
out, schemes = Path(sys.argv[1]), sys.argv[2:]
from attnlab.tasks import TASKS
print("| task | chance | " + " | ".join(schemes) + " |")
print("|---|---|" + "---|" * len(schemes))
for task in ("shift", "reverse", "sort"):
    for key in ("test/acc", "test/acc@32", "test/acc@64"):
        cells = []
        for s in schemes:
            f = out / f"{task}_{s}" / "summary.json"
            m = json.loads(f.read_text())["metrics"] if f.is_file() else {}
            cells.append(f"{100 * m[key]:.1f}" if key in m else "–")
        dm = TASKS[task]()  # the config's defaults: vocab 16, lengths min_length..32
        lengths = (dm.min_length, 32) if key == "test/acc" else (int(key.split("@")[1]),) * 2
        chance = dm.bag_of_tokens_accuracy(*lengths)  # best permutation-equivariant accuracy
        print(f"| {task} {key} | {100 * chance:.1f} | " + " | ".join(cells) + " |")
print()
print("wall time (s): " + ", ".join(
    f"{t}_{s} {json.loads((out / f'{t}_{s}' / 'summary.json').read_text())['wall_time_s']:.0f}"
    for t in ("shift", "reverse", "sort") for s in schemes if (out / f"{t}_{s}" / "summary.json").is_file()))
PY
