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

finish() {
  echo "runtime: $(($(date +%s) - START)) s"
  $PY -m attnlab.dashboard "$RUNS" --csv "experiments/$1/summary.csv" > /dev/null
  echo "wrote experiments/$1/summary.csv and $RUNS/dashboard.html"
}
