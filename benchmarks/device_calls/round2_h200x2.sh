# The three calls on nvidia-h200-x2 that made the figures of the README's "The flow on one and two
# H200s" (2026-12-01), after the six bundle calls:  PART=a|b|c BUDGET=555 bash benchmarks/device_calls/round2_h200x2.sh
BUDGET=${BUDGET:-555}; source benchmarks/device_calls/common.sh
setup
case "${PART:-a}" in
a)  # one GPU each, side by side: the quickstart iteration on GPU 0, the GPU check on GPU 1
  ( run q1 0 120 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
        --dynamic-bsz --compile --iters 2 --reference-tokens-per-s 36819
    run uk 0 100 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
        --mean-response-len 128 --dynamic-bsz --iters 1 ) &
  ( run c1 1 120 $PY benchmarks/gpu_check.py --device cuda --ranks 1 --prompts 256 --prompt-len 512 --response-len 256 --micro-batch 32
    run up 1 100 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
        --mean-response-len 128 --iters 1 ) &
  wait ;;
b)  # both GPUs
  run q2 0,1 150 $PY benchmarks/iteration.py $Q --ranks 2 --engine vllm --prompts 512 --log-prob-micro-batch 32 \
      --dynamic-bsz --compile --iters 2 --baseline /root/res/q1/iteration_bench.json
  PPOFLOW_FAULT=rank_exit:update_actor:1 run c2 0,1 150 $PY benchmarks/gpu_check.py --device cuda --ranks 2 --tp 2 \
      --prompts 256 --prompt-len 512 --response-len 256 --micro-batch 32 ;;
c)
  run c2b 0,1 150 $PY benchmarks/gpu_check.py --device cuda --ranks 2 --tp 2 --no-resume --prompts 256 --prompt-len 512 \
      --response-len 256 --micro-batch 32
  run up 0 100 $PY benchmarks/iteration.py $Q --ranks 1 --engine vllm --prompts 256 --log-prob-micro-batch 32 \
      --mean-response-len 128 --iters 1 ;;
esac
