# Shared by the studies' run.sh scripts: `sweep NAME OVERRIDES...` runs one Hydra multirun (joblib, 2 jobs at a time on
# a 2-core machine) into $RUNS/NAME over the seeds $SEEDS, its log in $RUNS/NAME.log; `finish STUDY` prints the runtime
# and writes the study's summary.csv from every run folder under $RUNS. Set PY to choose the Python (default python);
# PY=: prints each sweep's overrides and runs nothing (tests/test_experiments.py checks them that way). DRY_RUN=1 runs
# nothing either: each sweep's `train.py --dry-run` estimate is printed, and their sum at the end (`finish`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-python}
SEEDS=${SEEDS:-0,1,2}
START=$(date +%s)
DRY_RUN=${DRY_RUN:-0}
ESTIMATE_S=0

# `dry NAME ARGS...`: DRY_RUN=1's stand-in for a sweep: the plan's estimate line, added to ESTIMATE_S
dry() {
  local name=$1 line
  shift
  line=$($PY train.py "$@" --dry-run 2>&1 | grep '^estimated:') || { echo "dry run of $name failed"; exit 1; }
  echo "== $name: $line"
  ESTIMATE_S=$((ESTIMATE_S + $(echo "$line" | sed -E 's/^estimated: [^(]*\(([0-9.]+) min.*/\1/' | awk '{printf "%d", $1 * 60}')))
}

sweep() {
  local name=$1
  shift
  if [ "$DRY_RUN" = 1 ]; then dry "$name" -m hydra/launcher=joblib "$@" seed="$SEEDS"; return; fi
  mkdir -p "$RUNS"
  echo "== $name: $*"
  $PY train.py -m hydra/launcher=joblib "$@" seed="$SEEDS" hydra.sweep.dir="$RUNS/$name" > "$RUNS/$name.log" 2>&1 \
    || { echo "sweep $name failed (see $RUNS/$name.log)"; exit 1; }
}

# `tuned NAME OVERRIDES...`: the same multirun with the tuned sweeper (hydra/sweeper=tuned, attnlab.training.tuned):
# each configuration on the learning rates $GRID with seed 0, then at its best one on the seeds $TUNED_SEEDS (run
# folders $RUNS/NAME/tune/* and $RUNS/NAME/seeds/*); $TUNE_METRIC and $TUNE_DIRECTION choose what "best" means
# (default: val/acc_best, maximize)
tuned() {
  local name=$1
  shift
  local args=(-m hydra/launcher=joblib hydra/sweeper=tuned "$@" "hydra.sweeper.grid={lr:[${GRID:-1e-3,3e-3,1e-2}]}"
    "hydra.sweeper.seeds=[${TUNED_SEEDS:-1,2,3}]" "hydra.sweeper.metric=${TUNE_METRIC:-val/acc_best}"
    "hydra.sweeper.direction=${TUNE_DIRECTION:-maximize}")
  if [ "$DRY_RUN" = 1 ]; then dry "$name" "${args[@]}"; return; fi
  mkdir -p "$RUNS"
  echo "== $name: $*"
  $PY train.py "${args[@]}" hydra.sweep.dir="$RUNS/$name" > "$RUNS/$name.log" 2>&1 \
    || { echo "sweep $name failed (see $RUNS/$name.log)"; exit 1; }
}

# `finish STUDY [CSV]`: the runtime, then experiments/STUDY/CSV (default summary.csv) from every run under $RUNS
finish() {
  local csv=${2:-summary.csv}
  if [ "$DRY_RUN" = 1 ]; then
    echo "estimated in all: $((ESTIMATE_S / 60)) min (the sum of the sweeps' --dry-run estimates; nothing was run)"
    exit 0
  fi
  echo "runtime: $(($(date +%s) - START)) s"
  $PY -m attnlab.dashboard "$RUNS" --csv "experiments/$1/$csv" > /dev/null
  echo "wrote experiments/$1/$csv and $RUNS/dashboard.html"
}
