# What issue 11 still needs measured (not run yet): the flow's generation on one H200 with the garbage
# collector's heap frozen around generate (workers/rollout/gc_heap.py), next to plain vLLM in the same
# call; the worker cycle with --compile shows the collector's seconds (rollout/gc_s) cycle by cycle, idle
# and with both checkpoint writes behind it (write-both: the other suspect for the flow's slower warm
# generations, which overlap the previous iteration's actor and critic writes).
#   BUDGET=560 bash benchmarks/device_calls/next_generation.sh      (one call, after the bundle calls)
BUDGET=${BUDGET:-560}; source benchmarks/device_calls/common.sh
setup
run ref 0 90 $PY benchmarks/vllm_reference.py --engines graphs-mem0.3-inproc --variants seed+nolp --repeats 5 \
    --log $OUTDIR/ref_table.log
run flow 0 250 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
    --dynamic-bsz --compile --iters 2 --reference-tokens-per-s ${REF:-28450}
run cycle 0 150 $PY benchmarks/rollout_cycle.py $Q --prompts 256 --log-prob-micro-batch 32 --dynamic-bsz --compile \
    --cycles 4 --conditions idle write-both
