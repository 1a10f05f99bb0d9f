# Shared by the studies' scripts (experiments/<study>/run.sh, longer.sh, tuned.sh, ...), which source it first.
#
# Where a script writes. A study's published results are its committed files in experiments/<study>/: summary.csv
# (longer.csv, tuned.csv, ...) and its figures. A script never writes them unless asked to: by default everything it
# makes goes to a new folder, $OUT (outputs/<study>/<date>_<time>_<script>): the run folders in $OUT/runs (with the
# dashboard, $OUT/runs/dashboard.html), and the CSV, the figures and the other tables in $OUT itself ($RESULTS).
# UPDATE=1 writes those to experiments/<study>/ instead (RESULTS=experiments/<study>), to update the published
# results; the run folders still go to $OUT/runs. Neither $OUT nor $RUNS may lie under experiments/.
#
# Knobs (environment), read by every study script:
#   OUT=DIR          the run's folder, relative to the repository (default outputs/<study>/<YYYY-MM-DD_HH-MM-SS>_<script>,
#                    new each time); in an earlier run's folder a tuned sweep runs only the jobs it lacks, and a plain
#                    sweep refuses a job whose folder holds a finished run
#   UPDATE=1         write the CSV and the figures over the published ones in experiments/<study>/ (default 0: $OUT)
#   RUNS=DIR         the run folders (default $OUT/runs)
#   SEEDS=0,1,2      the seeds of a plain sweep (`sweep`)
#   PY=python        the Python (default: .venv/bin/python where it exists and no environment is activated, else
#                    python); PY=: prints each sweep's overrides and runs nothing (tests/test_experiments.py reads
#                    them so)
#   DRY_RUN=1        runs nothing: each sweep's `train.py --dry-run` estimate, and their sum at the end (`finish`)
# and by the scripts that run tuned sweeps (`tuned`):
#   GRID=a,b         the learning rates of the grid (each script sets its own default)
#   TUNED_SEEDS=1,2,3  the seeds the chosen rate runs on
#   TUNE_METRIC=val/acc_best, TUNE_DIRECTION=maximize   what "best" means (a script that sets them fixes them)
# A script's own knobs (MODELS, LRS, ...) are listed in its header; docs/experiments.md lists them all.
# tests/test_experiments_scripts.py checks that every knob a script reads is named in its header, and that nothing
# is written to experiments/<study>/ without UPDATE=1.
set -euo pipefail
_script=${BASH_SOURCE[1]:-$0}  # the script that sources this file: experiments/<study>/<script>.sh
STUDY=$(basename "$(cd "$(dirname "$_script")" && pwd)")
SCRIPT=$(basename "$_script" .sh)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${PY:-}" ]; then
  if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
SEEDS=${SEEDS:-0,1,2}
START=$(date +%s)
DRY_RUN=${DRY_RUN:-0}
UPDATE=${UPDATE:-0}
OUT=${OUT:-outputs/$STUDY/$(date +%Y-%m-%d_%H-%M-%S)_$SCRIPT}
RUNS=${RUNS:-$OUT/runs}
PUBLISHED=experiments/$STUDY
ESTIMATE_S=0

# `_outside_experiments NAME DIR`: refuse a folder under experiments/ (where only the published results live)
_outside_experiments() {
  local where
  where=$(realpath -m "$2")
  case "$where/" in
    "$(realpath -m experiments)"/*)
      echo "error: $1=$2 is under experiments/, which holds only the published results; run folders and a run's" \
        "results go elsewhere (default outputs/$STUDY/...), and UPDATE=1 writes the published CSV and figures" >&2
      exit 2
      ;;
  esac
}
_outside_experiments OUT "$OUT"
_outside_experiments RUNS "$RUNS"
case "$UPDATE" in
  1) RESULTS=$PUBLISHED ;;
  0) RESULTS=$OUT ;;
  *) echo "error: UPDATE=$UPDATE: 1 writes the published results of experiments/$STUDY, 0 (the default) $OUT" >&2; exit 2 ;;
esac
if [ "$PY" != ":" ] && [ "$DRY_RUN" != 1 ]; then
  mkdir -p "$RESULTS"
  echo "results: $RESULTS$([ "$UPDATE" = 1 ] && echo ' (UPDATE=1: the published results)'); run folders: $RUNS"
fi

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

# `runtime`: the seconds since the script started; under DRY_RUN=1 the sum of the sweeps' estimates instead, and the
# script ends there (nothing was run, so there is nothing to summarise)
runtime() {
  if [ "$DRY_RUN" = 1 ]; then
    echo "estimated in all: $((ESTIMATE_S / 60)) min (the sum of the sweeps' --dry-run estimates; nothing was run)"
    exit 0
  fi
  echo "runtime: $(($(date +%s) - START)) s"
}

# `finish [CSV]`: `runtime`, then $RESULTS/CSV (default summary.csv) from every run under $RUNS, and the dashboard
# $RUNS/dashboard.html
finish() {
  local csv=${1:-summary.csv}
  runtime
  $PY -m attnlab.dashboard "$RUNS" --csv "$RESULTS/$csv" > /dev/null
  echo "wrote $RESULTS/$csv and $RUNS/dashboard.html"
}

# `in_results SCRIPT.py ARGS...`: a study's Python script that reads and writes beside itself (its HERE: analyze.py,
# plot.py, ...) run as `python SCRIPT.py ARGS...` but with its folder taken to be $RESULTS, so that it reads this
# run's CSV and writes its figures there (experiments/<study>/ only with UPDATE=1). Nothing under PY=:.
in_results() {
  [ "$PY" = ":" ] && return 0
  local script=$1
  shift
  $PY - "$script" "$RESULTS" "$@" <<'PY'
import sys
from pathlib import Path

script, results, *args = sys.argv[1:]
source = Path(script).resolve()
sys.path[:0] = [str(source.parent), str(source.parent.parent)]  # (its imports: the study's folder, experiments/)
sys.argv = [str(source), *args]
code = compile(source.read_text(), str(source), "exec")
exec(code, {"__name__": "__main__", "__file__": str(Path(results).resolve() / source.name)})
PY
}
