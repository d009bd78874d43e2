# Where ppoflow's generation and weight sync lose time against plain vLLM (issue 11; run 2026-12-01:
# docs/bench/engine_gap_h200.log), on an otherwise idle one-GPU machine: plain vLLM as measured before and
# with ppoflow's engine settings (sleep mode + external launcher), with and without log-probs; then the flow's
# own actor worker, cycle by cycle (benchmarks/rollout_cycle.py: idle, a checkpoint written behind it by this
# process or another one, log-probs off); then the real flow if time is left.
#   BUDGET=560 bash benchmarks/device_calls/engine_gap.sh      (one call, after the bundle calls)
BUDGET=${BUDGET:-560}; source benchmarks/device_calls/common.sh
setup
run ref 0 100 $PY benchmarks/vllm_reference.py --engines graphs-mem0.3-inproc graphs-mem0.3-inproc-sleep-extl \
    --variants seed+lp seed+nolp --repeats 3 --log $OUTDIR/ref_table.log
run cycle 0 150 $PY benchmarks/rollout_cycle.py $Q --prompts 256 --log-prob-micro-batch 32 --dynamic-bsz --cycles 3
run flow 0 260 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
    --dynamic-bsz --compile --iters 2
