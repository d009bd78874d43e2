# What issue 11 still needs measured (not run yet): ppoflow's generation and weight sync against plain
# vLLM on an otherwise idle one-GPU machine, with and without a checkpoint written behind them.
#   BUDGET=555 bash benchmarks/device_calls/next_generation.sh      (one call, after the bundle calls)
BUDGET=${BUDGET:-555}; source benchmarks/device_calls/common.sh
setup
run ref 0 90 $PY benchmarks/vllm_reference.py --engines graphs-mem0.3-inproc --repeats 2
run async 0 150 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
    --dynamic-bsz --compile --iters 2 --reference-tokens-per-s 36819
run sync 0 150 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
    --dynamic-bsz --iters 2 --sync-checkpoints --reference-tokens-per-s 36819
