# Shared by the studies' run.sh scripts: `sweep NAME OVERRIDES...` runs one Hydra multirun (joblib, 2 jobs at a time on
# a 2-core machine) into $RUNS/NAME over the seeds $SEEDS, its log in $RUNS/NAME.log; `finish STUDY` prints the runtime
# and writes the study's summary.csv from every run folder under $RUNS. Set PY to choose the Python (default python);
# PY=: prints each sweep's overrides and runs nothing (tests/test_experiments.py checks them that way).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-python}
SEEDS=${SEEDS:-0,1,2}
START=$(date +%s)

sweep() {
  local name=$1
  shift
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
  mkdir -p "$RUNS"
  echo "== $name: $*"
  $PY train.py -m hydra/launcher=joblib hydra/sweeper=tuned "$@" "hydra.sweeper.grid={lr:[${GRID:-1e-3,3e-3,1e-2}]}" \
    "hydra.sweeper.seeds=[${TUNED_SEEDS:-1,2,3}]" "hydra.sweeper.metric=${TUNE_METRIC:-val/acc_best}" \
    "hydra.sweeper.direction=${TUNE_DIRECTION:-maximize}" hydra.sweep.dir="$RUNS/$name" > "$RUNS/$name.log" 2>&1 \
    || { echo "sweep $name failed (see $RUNS/$name.log)"; exit 1; }
}

# `finish STUDY [CSV]`: the runtime, then experiments/STUDY/CSV (default summary.csv) from every run under $RUNS
finish() {
  local csv=${2:-summary.csv}
  echo "runtime: $(($(date +%s) - START)) s"
  $PY -m attnlab.dashboard "$RUNS" --csv "experiments/$1/$csv" > /dev/null
  echo "wrote experiments/$1/$csv and $RUNS/dashboard.html"
}
