# Issue 11 (run 2026-12-01: docs/bench/generation_h200_cpu.log): the flow's generation against plain vLLM on one machine, with the CPU each
# got. Plain vLLM with ppoflow's engine settings runs before and after the flow (host drift shows as a change
# between the two), every run and iteration printing the decoding thread's CPU seconds and the host's busy and
# stolen shares (infra/host_cpu.py); then the actor worker alone, idle and with both checkpoint writes behind it.
#   BUDGET=560 PART=a bash benchmarks/device_calls/generation_cpu.sh   (after the bundle calls)
#   BUDGET=400 PART=b bash ...                                         (the next call, same machine)
BUDGET=${BUDGET:-560}; source benchmarks/device_calls/common.sh
setup
plain() {
  run "$1" 0 90 $PY benchmarks/vllm_reference.py --engines graphs-mem0.3-inproc-sleep-extl --variants seed+nolp \
      --repeats 5 --log $OUTDIR/$1_table.log
  grep -h "seed+nolp: " $OUTDIR/$1.log | cut -c1-400
}
if [ "${PART:-a}" = a ]; then
  plain plain_before
  REF=$(awk '$5 == "seed+nolp" && $8 ~ /^[0-9]+$/ {print $8}' $OUTDIR/plain_before_table.log 2>/dev/null | tail -1)
  run flow 0 250 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
      --dynamic-bsz --compile --iters ${ITERS:-3} --reference-tokens-per-s ${REF:-32283}
  grep -h "^generation per iteration" $OUTDIR/flow.log
else
  plain plain_after
  run cycle 0 150 $PY benchmarks/rollout_cycle.py $Q --prompts 256 --log-prob-micro-batch 32 --dynamic-bsz \
      --compile --cycles ${CYCLES:-4} --conditions idle write-both
  grep -h "decoding thread's CPU" $OUTDIR/cycle.log | cut -c1-300
fi
