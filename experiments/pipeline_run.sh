# Sourced by experiments/*.sh (needs R, the runs dir, and PY): one BeNice! pipeline run per call.
# pipeline NAME SEED CONFIG_ARG [flags...] runs configs/benice.py<CONFIG_ARG> in R/NAME_s<SEED>,
# its log in R/NAME_s<SEED>.log; rerunning skips what finished and resumes what did not.
pipeline() {
  local name=$1 seed=$2 arg=$3
  shift 3
  echo "== ${name}_s$seed ($(date))"
  "$PY" -m looped.main --config="configs/benice.py$arg" --workdir="$R/${name}_s$seed" \
    --config.seed="$seed" "$@" > "$R/${name}_s$seed.log" 2>&1
}
