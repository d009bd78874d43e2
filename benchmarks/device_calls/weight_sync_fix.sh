# Issue 11 (run 2026-12-01: PART=a docs/bench/weight_sync_fix_h200.log, PART=b
# docs/bench/iteration_h200_quickstart_nolp.log), after the fixes of this round (log-probs off by default, the
# checkpoint write paused during the weight push, torch's cache kept when the engine fits next to it, no
# collective on one-rank meshes): plain vLLM, 5 runs with and without log-probs, then the flow's actor worker
# cycle by cycle.
#   BUDGET=560 PART=a bash benchmarks/device_calls/weight_sync_fix.sh    (after the bundle calls)
#   BUDGET=560 PART=b bash ...                                          (the flow itself, next call)
BUDGET=${BUDGET:-560}; source benchmarks/device_calls/common.sh
setup
if [ "${PART:-a}" = a ]; then
  run ref 0 90 $PY benchmarks/vllm_reference.py --engines graphs-mem0.3-inproc --variants seed+lp seed+nolp \
      --repeats 5 --log $OUTDIR/ref_table.log
  run cycle 0 150 $PY benchmarks/rollout_cycle.py $Q --prompts 256 --log-prob-micro-batch 32 --dynamic-bsz \
      --cycles 5 --conditions idle write-here lp
else
  run flow 0 250 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
      --dynamic-bsz --compile --iters ${ITERS:-2} --reference-tokens-per-s ${REF:-28450}
  run flowsync 0 200 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
      --dynamic-bsz --iters 2 --sync-checkpoints --reference-tokens-per-s ${REF:-28450}
fi
