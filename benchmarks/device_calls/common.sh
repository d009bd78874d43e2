# Sourced by the device-call scripts beside it (run from the repository root on a GPU machine):
# benchmarks bounded by one deadline (BUDGET seconds from now), one log per run under $OUT, and the
# headline lines of each printed as it ends. The first call builds the GPU venv from the wheels that
# ../shared/tools/gpu-bundle put in /root/stash (make setup-gpu WHEELS=/root/bundle).
#   run NAME GPUS MIN_SECONDS CMD...   runs CMD on CUDA_VISIBLE_DEVICES=GPUS with a slots dir of its
#   own (two runs side by side on two GPUs), skipped when fewer than MIN_SECONDS are left.
OUTDIR=$OUT
T0=$(date +%s); DEADLINE=$((T0 + BUDGET))
left() { echo $(( DEADLINE - $(date +%s) )); }
PY=.venv/bin/python
Q="--preset qwen2.5-0.5b --device cuda --prompt-len 512 --response-len 256 --micro-batch 32"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
setup() {
  mkdir -p /root/bundle /root/res
  if [ ! -x .venv/bin/python ]; then
    [ -f /root/bundle/.ok ] || { cat /root/stash/part.* | tar -x -C /root/bundle && touch /root/bundle/.ok; }
    { time make setup-gpu WHEELS=/root/bundle; } > $OUTDIR/setup.log 2>&1 || { echo "setup failed"; tail -40 $OUTDIR/setup.log; exit 1; }
  fi
  tail -4 $OUTDIR/setup.log 2>/dev/null
}
# run NAME GPUS MIN_SECONDS CMD...: skipped when less than MIN_SECONDS are left
run() {
  local name=$1 gpus=$2 min=$3; shift 3
  local t; t=$(left)
  if [ "$t" -lt "$min" ]; then echo "$name: skipped, ${t}s left"; return; fi
  local s; s=$(date +%s)
  ( export CUDA_VISIBLE_DEVICES=$gpus PPOFLOW_SLOTS_DIR=/tmp/slots-$name OUT=$OUTDIR/res-$name
    mkdir -p "$OUT"; echo "# $(date -u +%FT%TZ) CUDA_VISIBLE_DEVICES=$gpus $*"; timeout -k 15 "$t" "$@" ) > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - s ))s; disk free $(df -h --output=avail /tmp | tail -1), memory free $(free -g | awk '/Mem/ {print $7}') GiB"
  grep -E "^(rollout cycle|generation tokens/s|  best cycle|    of which GC|    in the GC|    push|    wake|    cache  weight sync|  generation  |[a-z0-9.-]+ +(seed|noseed)\+|iteration \(|  of which generation|  of which weight|actor update MFU|checkpoint on|generation vs|scaling vs|gpu_check:|flow run:|summary:)" "$OUTDIR/$name.log" | cut -c1-400
}
