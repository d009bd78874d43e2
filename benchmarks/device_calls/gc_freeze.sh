# Issue 11 (run 2026-12-01: docs/bench/generation_h200_gc_freeze.log): the flow's generation on one H200 with
# the garbage collector's heap frozen around generate (workers/rollout/gc_heap.py), next to plain vLLM measured
# in the same call (its median without log-probs is the flow's yardstick); then the worker cycle with --compile,
# which shows the collector's seconds (rollout/gc_s) cycle by cycle, idle and with both checkpoint writes behind
# it (write-both: the other suspect for the flow's slower warm generations, which overlap the previous
# iteration's actor and critic writes).
#   BUDGET=570 PART=a bash benchmarks/device_calls/gc_freeze.sh   (after the bundle calls)
#   BUDGET=400 PART=b bash ...                                          (the next call, same machine)
BUDGET=${BUDGET:-560}; source benchmarks/device_calls/common.sh
setup
if [ "${PART:-a}" = a ]; then
  run ref 0 90 $PY benchmarks/vllm_reference.py --engines graphs-mem0.3-inproc --variants seed+nolp --repeats 5 \
      --log $OUTDIR/ref_table.log
  # the median run's tokens/s of plain vLLM without log-probs (column 'median tok/s' of the table)
  REF=$(awk '$5 == "seed+nolp" && $8 ~ /^[0-9]+$/ {print $8}' $OUTDIR/ref_table.log 2>/dev/null | tail -1)
  echo "plain vLLM median (same call): ${REF:-none, using 28450}"
  run flow 0 250 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
      --dynamic-bsz --compile --iters ${ITERS:-2} --reference-tokens-per-s ${REF:-28450}
else
  run cycle 0 150 $PY benchmarks/rollout_cycle.py $Q --prompts 256 --log-prob-micro-batch 32 --dynamic-bsz \
      --compile --cycles ${CYCLES:-4} --conditions idle write-both
fi
