# Plain vLLM on the machine of the day (run 2026-12-01: docs/bench/generation_h200_second_host.log): the same
# request (seeds, no log-probs) with the engine core in this process (ppoflow's layout), in its own process
# (vLLM's default) and with ppoflow's engine settings (sleep mode + external launcher); then the flow again for
# more warm iterations.
#   BUDGET=400 PART=a bash benchmarks/device_calls/engine_process.sh   (after the bundle calls)
#   BUDGET=380 PART=b bash ...                                         (the next call, same machine)
BUDGET=${BUDGET:-400}; source benchmarks/device_calls/common.sh
setup
if [ "${PART:-a}" = a ]; then
  run ref 0 90 $PY benchmarks/vllm_reference.py --engines graphs-mem0.3-inproc graphs-mem0.3-mp \
      graphs-mem0.3-inproc-sleep-extl --variants seed+nolp --repeats 5 --budget-s $(( $(left) - 20 )) \
      --log $OUTDIR/ref_table.log
else
  run flow 0 250 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
      --dynamic-bsz --compile --iters ${ITERS:-3} --reference-tokens-per-s ${REF:-26083}
fi
