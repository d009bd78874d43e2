# Issue 11 (run 2026-12-01: docs/bench/generation_h200_paired.log), paired: ppoflow's rollout and vLLM's own LLM.generate take turns on one engine
# in one process (rollout_cycle.py --conditions idle plain), with the core's and the GPU's speed probed
# before every generation (speed_probes.py); then plain vLLM alone in its own process, probed the same way.
#   BUDGET=540 bash benchmarks/device_calls/generation_paired.sh   (after the bundle calls)
BUDGET=${BUDGET:-540}; source benchmarks/device_calls/common.sh
setup
run cycle 0 200 $PY benchmarks/rollout_cycle.py $Q --prompts 256 --log-prob-micro-batch 32 --dynamic-bsz \
    --compile --cycles ${CYCLES:-5} --conditions idle plain
grep -hE "^  (idle|plain) |^ppoflow's rollout|before \(" $OUTDIR/cycle.log | cut -c1-400
run plain 0 110 $PY benchmarks/vllm_reference.py --engines graphs-mem0.3-inproc-sleep-extl --variants seed+nolp \
    --repeats 5 --log $OUTDIR/plain_table.log
