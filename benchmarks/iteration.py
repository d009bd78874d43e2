"""Warm PPO iterations of the real ``ppo`` flow at a configurable shape; prints one table.

The benchmark builds a random-weight model of the chosen shape, a parquet prompt set of the chosen
prompt length, an experiment config, and runs ``ppoflow.flows.ppo.ppo`` for ``1 + K`` iterations in one
flow run (ephemeral Prefect, local files): the first iteration pays the cold starts (worker
groups, engine warm-up), the next ``K`` are warm. It then reads the warm iterations'
``metrics.json`` and prints seconds per task, weight-sync seconds, tokens/s per stage, the actor
update's MFU (on GPU) and the share of the iteration spent outside model compute.

    python benchmarks/iteration.py --preset tiny --device cpu --ranks 2 --engine vllm       # CPU
    python benchmarks/iteration.py --arch gemma3_text ...  # a model matrix row's real small shape
    python benchmarks/iteration.py --preset qwen2.5-0.5b --device cuda --ranks 1 --engine vllm \\
        --prompts 256 --prompt-len 512 --response-len 256 --micro-batch 32 \\
        --log-prob-micro-batch 32 --reference-tokens-per-s 36819                       # one H200
    ... --mean-response-len 128 [--dynamic-bsz]          # uneven responses, padded or packed
    ... --response-len 8192 --dynamic-bsz --max-token-len 16896 --log-prob-max-token-len 33792 \
        --recompute --gpu-memory-utilization 0.5            # long responses (docs/gpus.md's guide)
    ... --dynamic-bsz --sp 2 --ranks 2                   # sequence parallel (Ulysses) updates
    ... --storage DIR --iters 20 [--resume]              # a run longer than one sitting: run the same
                                                         # command again with --resume to finish it

Uneven responses: a random-weight model samples close to uniformly over its vocabulary, so it
almost never stops. ``--mean-response-len L`` gives the model ``V / L`` extra stop tokens (in its
``generation_config.json``, which both engines honour): each sampled token then ends the response
with probability about ``1 / L``, and lengths spread from 1 to ``--response-len`` as they do with
a real stop token. ``--dynamic-bsz`` runs the actor, reference and critic with packed micro-batches
of ``--max-token-len`` real tokens (default: micro-batch x (prompt + response)); tokens/s count
real tokens, so the two runs side by side show the packing gain.

The engine flags (``--eager``, ``--gpu-memory-utilization``, ``--kv-cache-gib``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--tp``, ``--sleep-level``, ``--loader``, ``--[no-]rollout-log-probs``)
set the ``rollout`` section; unset, the config's defaults apply (CUDA graphs on GPU, sleep level 2
next to the actor, the engine's log-probs on).

Sampler vs trainer (``benchmarks/mismatch_report.py`` prints it): with the engine's log-probs the
table ends with each iteration's ``mismatch/*`` (and ``correction/*``) metrics. ``--trainer-dtype``
computes the FSDP actor in bf16 (the GPU default, mixed precision over fp32 parameters) or fp32;
``--behaviour``, ``--tis``, ``--mis`` (with ``--tis-cap``, ``--mis-lower``, ``--mis-upper``) set
``algorithm.rollout_correction``. ``--compare`` runs the shape twice and prints the two side by side:
``log-probs`` (the engine's log-probs off, then on: their cost in generation), ``behaviour``
(trainer, then sampler: the old-log-prob pass the bypass saves), ``trainer-dtype`` (bf16, then
fp32: the mismatch each gives), ``correction`` (none, then the one the flags name).
``--reference-tokens-per-s`` (plain vLLM's rate on the same GPU, model, batch and sampling:
``benchmarks/vllm_reference.py``) adds a line comparing the rollout with it; ``--baseline`` (the
summary JSON another run printed, or its file) adds the scaling against that run.

On GPU the table also gives each worker group's memory per rank, from the ranks' own metrics
(``perf/mem/*``: torch's caching allocator; the engine's sleep-mode pool counted only while awake)
and the device-wide peak over the run (``nvidia-smi``, every process), and the summary JSON is
written to ``$OUT/iteration_bench.json`` when ``OUT`` is set.

Checkpoints: the update tasks stage the state to host memory and return; the groups write it in
the background while the next iteration runs, and commit n waits for it. The table shows the
checkpoint seconds on the critical path (staging, plus waiting for the previous write when it was
still running), the background write seconds, and how long each commit waited after the updates.
Iterations overlap (commit n lands during iteration n+1), so the steady-state seconds per
iteration are the interval between consecutive commits; "iteration (latency)" is one iteration's
start to its commit. ``--sync-checkpoints`` writes inside the update tasks instead (the old way),
``--overlap one_step`` generates iteration n+1 from the weights before update n.

"Outside model compute" = the iteration's wall time minus the model compute on its critical path:
generation, old log-probs (rank-side times), the longer of the reference and value tasks (task
times, so their dispatch I/O counts as compute here), advantage, and the longer of the two
rank-side update times. What remains is Prefect, Arrow I/O on storage, the dispatch to the ranks,
the FSDP->engine weight sync and checkpoint writes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time

PRESETS = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256),
    "small": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024),
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
    ),
}
#: ``--arch NAME`` sets the preset to this prefix + NAME: the matrix row's real small shape.
ARCH_PRESET = "arch:"
#: ``--size NAME``: the size ladder (docs/gpus.md), real shapes of 1.5B-8B models as a matrix row
#: with its fields overridden (random weights; the demo's byte tokenizer uses the first ids).
SIZES = {
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            hidden_size=1536,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            intermediate_size=8960,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-4b": (
        "qwen3",
        dict(
            hidden_size=2560,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=9728,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-8b": (
        "qwen3",
        dict(
            hidden_size=4096,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=12288,
            tie_word_embeddings=False,
        ),
    ),
}
SIZE_PRESET = "size:"
PEAK_TFLOPS = {
    "cuda": 791.0
}  # bf16 dense matmul TFLOP/s measured on one H200 (--peak-tflops for another card)


def kv_budget(text: str) -> float | str | None:
    """``--kv-cache-gib``: a number of GiB, ``auto`` or ``profile`` (rollout.kv_cache_gib None)."""
    return text if text in ("auto", "profile") else float(text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument(
        "--arch",
        choices=arch_names(),
        default=None,
        help="instead of --preset: a row of the model matrix (infra/architectures) at its real small shape",
    )
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default=None,
        help="instead of --preset: a rung of the size ladder (docs/gpus.md), random weights at its real shape",
    )
    p.add_argument(
        "--estimator",
        choices=("gae", "grpo"),
        default="gae",
        help="gae: a critic and the KL in the reward (the quickstart); grpo: no critic, no KL term "
        "(so no reference model; use --n > 1 for groups)",
    )
    p.add_argument(
        "--offload",
        choices=("none", "optimizer", "params", "both"),
        default="none",
        help="FSDP offload of the trained groups to host memory (optimizer states, parameters)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    p.add_argument("--n", type=int, default=1, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument(
        "--mini-batch", type=int, default=None, help="prompts per optimizer step (default prompts/4)"
    )
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward per rank")
    p.add_argument("--log-prob-micro-batch", type=int, default=8)
    p.add_argument("--recompute", action="store_true", help="activation checkpointing in the updates")
    p.add_argument(
        "--mean-response-len", type=int, default=0, help="add stop tokens for about this mean (0: none)"
    )
    p.add_argument("--dynamic-bsz", action="store_true", help="packed token-budget micro-batches")
    p.add_argument("--max-token-len", type=int, default=None, help="tokens per update micro-batch per rank")
    p.add_argument(
        "--log-prob-max-token-len",
        type=int,
        default=None,
        help="tokens per log-prob/values micro-batch per rank (default: log-prob micro-batch x row)",
    )
    p.add_argument(
        "--sp",
        type=int,
        default=1,
        help="sequence_parallel_size of the actor, reference and critic (needs --dynamic-bsz)",
    )
    p.add_argument("--compile", action="store_true", help="model.use_torch_compile")
    p.add_argument("--iters", type=int, default=2, help="warm iterations timed (after one warm-up)")
    p.add_argument(
        "--sync-checkpoints", action="store_true", help="write checkpoints inside the update tasks"
    )
    p.add_argument(
        "--snapshot-every", type=int, default=None, help="checkpoint.snapshot_every (default: the config's)"
    )
    p.add_argument(
        "--no-final-snapshot",
        action="store_true",
        help="checkpoint.snapshot_at_end false: the last iteration writes no snapshot (a 4B model's "
        "fp32 weights and AdamW moments are 48 GB of disk)",
    )
    p.add_argument(
        "--deterministic", action="store_true", help="resources.deterministic (deterministic update kernels)"
    )
    p.add_argument("--overlap", choices=["none", "one_step"], default="none", help="algorithm.overlap")
    p.add_argument("--storage", default=None, help="where the experiment goes (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the experiment under --storage up to 1 + --iters iterations (a run longer than one sitting)",
    )
    e = p.add_argument_group("rollout engine (vllm)")
    e.add_argument("--tp", type=int, default=1, help="rollout.tensor_model_parallel_size")
    e.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--eager: no CUDA graphs; --no-eager: CUDA graphs (default: the config's, graphs on GPU)",
    )
    e.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    e.add_argument(
        "--kv-cache-gib",
        type=kv_budget,
        default=None,
        help="GiB, 'auto' (GPU default: sized to the batch) or 'profile' (vLLM sizes it from the utilization)",
    )
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--sleep-level", type=int, choices=(1, 2), default=None)
    e.add_argument("--loader", choices=("hf", "dtensor"), default="hf", help="push with TP > 1")
    e.add_argument(
        "--rollout-log-probs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rollout.calculate_log_probs: vLLM also returns its log-probs of the samples "
        "(default: the config's, on)",
    )
    mm = p.add_argument_group("sampler vs trainer (algorithm.rollout_correction)")
    mm.add_argument(
        "--trainer-dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="the FSDP actor's (and reference's, critic's) compute dtype: bf16 = mixed precision over "
        "fp32 parameters (default on cuda), fp32 = none (default on cpu)",
    )
    mm.add_argument("--behaviour", choices=("trainer", "sampler"), default="trainer")
    mm.add_argument("--tis", choices=("none", "token", "sequence"), default="none")
    mm.add_argument("--tis-cap", type=float, default=2.0)
    mm.add_argument("--mis", choices=("none", "token", "sequence", "geometric"), default="none")
    mm.add_argument("--mis-lower", type=float, default=None, help="default: the level's band")
    mm.add_argument("--mis-upper", type=float, default=None, help="default: the level's band")
    mm.add_argument(
        "--compare",
        choices=("log-probs", "behaviour", "trainer-dtype", "correction"),
        default=None,
        help="run the shape twice and print both side by side (module docstring)",
    )
    lo = p.add_argument_group("LoRA")
    lo.add_argument(
        "--lora-rank", type=int, default=0, help="actor.lora.rank and critic.lora.rank (0: full fine-tuning)"
    )
    lo.add_argument("--lora-alpha", type=float, default=None, help="lora.alpha (default: 2 x rank)")
    lo.add_argument("--lora-sync", choices=("adapter", "merged"), default="merged", help="actor.lora.sync")
    lo.add_argument(
        "--lora-compare",
        action="store_true",
        help="run full fine-tuning first, then LoRA of --lora-rank, and print them side by side",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the card's bf16 matmul TFLOP/s for the MFU (default: the H200's measured 791)",
    )
    c = p.add_argument_group("comparisons")
    c.add_argument(
        "--reference-tokens-per-s",
        type=float,
        default=None,
        help="plain vLLM's sampled tokens/s on one GPU at the same shape (benchmarks/vllm_reference.py)",
    )
    c.add_argument("--baseline", default=None, help="summary JSON (or its file) of a run to scale against")
    c.add_argument(
        "--minimal-compare",
        action="store_true",
        help="run the shape twice, tuned by these flags and then as a config that names only the "
        "model, the data (files, batch, lengths) and the estimator (GAE, KL in the reward), and "
        "compare the seconds between commits",
    )
    args = p.parse_args(argv)
    if args.arch:
        args.preset = ARCH_PRESET + args.arch
    if args.size:
        args.preset = SIZE_PRESET + args.size
    return args


def arch_names() -> list[str]:
    from ppoflow.infra.architectures import names

    return names()


def build_model(out_dir: str, preset: str, max_len: int, mean_response_len: int = 0) -> int:
    """Random-weight Qwen2-shaped model + the byte tokenizer; returns the parameter count. With
    ``mean_response_len`` the generation config lists ``V / mean_response_len`` stop tokens.

    The real shapes' weights (a matrix row, a ladder rung) are drawn on the GPU where there is one
    (an 8B model's init takes minutes on the host's cores, seconds on a GPU), in a child process,
    so that this process holds no CUDA context or cached blocks beside the run it measures."""
    import torch

    if preset.startswith((ARCH_PRESET, SIZE_PRESET)) and torch.cuda.is_available():
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(_build_model, (out_dir, preset, max_len, mean_response_len, "cuda"))
    return _build_model(out_dir, preset, max_len, mean_response_len, "cpu")


def _build_model(out_dir: str, preset: str, max_len: int, mean_response_len: int, device: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from ppoflow.demo.tiny_models import build_char_tokenizer, tiny_config

    tok = build_char_tokenizer()
    dtype = torch.float32
    if preset.startswith((ARCH_PRESET, SIZE_PRESET)):  # a matrix row (or a ladder rung) at its real shape
        from ppoflow.infra.architectures import real_config

        name, overrides = preset[len(ARCH_PRESET) :], {}
        if preset.startswith(SIZE_PRESET):
            name, overrides = SIZES[preset[len(SIZE_PRESET) :]]
            dtype = torch.bfloat16  # half the bytes to write and read; the trainer upcasts its copy
        cfg = real_config(name, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **overrides)
        vocab = cfg.vocab_size
    else:
        shape = dict(PRESETS[preset])
        vocab = shape.pop("vocab_size", len(tok))
        cfg = tiny_config(
            vocab,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            max_position_embeddings=shape.pop("max_position_embeddings", max(512, max_len)),
            **shape,
        )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if mean_response_len > 0:
        rng = random.Random(1)
        ordinary = range(len(tok), vocab) if vocab > 4 * len(tok) else range(5, vocab)  # not specials
        stops = rng.sample(list(ordinary), max(1, round(vocab / mean_response_len)))
        model.generation_config.eos_token_id = [tok.eos_token_id, *stops]
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def committed(cfg) -> int:
    """The last iteration the experiment of ``cfg`` committed (0: none, or no experiment yet)."""
    from ppoflow.infra.experiment.manifest import read_manifest
    from ppoflow.infra.experiment.paths import ExperimentPaths

    manifest = read_manifest(ExperimentPaths.of(cfg))
    return manifest.iteration if manifest is not None else 0


def model_params(model_dir: str) -> int:
    """The parameter count of the model ``build_model`` wrote (without loading its weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def build_prompts(url: str, count: int, prompt_len: int) -> None:
    """``count`` prompts of random text, ``prompt_len - 2`` bytes each (the chat template adds 2
    tokens; the byte tokenizer makes one token per byte), in veRL's parquet format."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +-="
    rows = [
        {
            "prompt": [
                {
                    "role": "user",
                    "content": "".join(rng.choice(alphabet) for _ in range(max(1, prompt_len - 2))),
                }
            ],
            "data_source": "openai/gsm8k",
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "42"},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(count)
    ]
    pq.write_table(pa.Table.from_pylist(rows), url)


def minimal_config(args, model_dir: str, data_url: str, root: str) -> dict:
    """What a user writes who names only the model, the data and the estimator, at the benchmark's
    shape (its prompts per iteration and lengths) and algorithm (GAE, the KL in the reward):
    device, ranks, dtypes, packing, token budgets, compile and the engine's settings are the
    config's defaults (``ppoflow.infra.config.defaults``)."""
    return {
        "model": {"path": model_dir},
        "data": {"train_files": [data_url], "train_batch_size": args.prompts},
        "rollout": {"prompt_length": args.prompt_len, "response_length": args.response_len},
        "algorithm": {"adv_estimator": "gae", "use_kl_in_reward": True},
        "storage": {"root": root, "experiment": "bench"},
    }


def experiment_config(args, model_dir: str, data_url: str, root: str) -> dict:
    if getattr(args, "minimal", False):
        return minimal_config(args, model_dir, data_url, root)
    cuda = args.device == "cuda"
    mini = args.mini_batch or max(1, args.prompts // 4)
    bf16 = (getattr(args, "trainer_dtype", None) or ("bf16" if cuda else "fp32")) == "bf16"
    fsdp = {"param_dtype": "bfloat16", "reduce_dtype": "float32"} if bf16 else {}
    offload = getattr(args, "offload", "none")
    trained_fsdp = {
        **fsdp,
        **({"optimizer_offload": True} if offload in ("optimizer", "both") else {}),
        **({"param_offload": True} if offload in ("params", "both") else {}),
    }
    grpo = getattr(args, "estimator", "gae") == "grpo"
    row = args.prompt_len + args.response_len
    sp = getattr(args, "sp", 1)
    per_rank_row = -(-row // sp)  # a row split over an sp group
    budget = args.max_token_len or args.micro_batch * row
    packing = {
        "use_dynamic_bsz": args.dynamic_bsz,
        "ppo_max_token_len_per_gpu": max(budget, per_rank_row),
        "sequence_parallel_size": sp,
    }
    log_prob_budget = max(
        getattr(args, "log_prob_max_token_len", None) or args.log_prob_micro_batch * row, per_rank_row
    )
    config = {
        "model": {
            "path": model_dir,
            "dtype": "float32",
            "enable_gradient_checkpointing": args.recompute,
            "use_torch_compile": args.compile,
        },
        "data": {"train_files": [data_url], "train_batch_size": args.prompts, "apply_chat_template": True},
        "rollout": {
            "engine": args.engine,
            "n": args.n,
            "temperature": 1.0,
            "prompt_length": args.prompt_len,
            "response_length": args.response_len,
            "dtype": "bfloat16" if cuda else None,
            "log_prob_micro_batch_size_per_gpu": args.log_prob_micro_batch,
            "tensor_model_parallel_size": args.tp,
            "kv_cache_gib": {None: "auto" if cuda else 0.5, "profile": None}.get(
                args.kv_cache_gib, args.kv_cache_gib
            ),
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "enforce_eager": args.eager,
            "max_num_seqs": args.max_num_seqs or "auto",
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "sleep_level": args.sleep_level,
            "weight_loader": args.loader,
            **({} if args.rollout_log_probs is None else {"calculate_log_probs": args.rollout_log_probs}),
        },
        "actor": {
            "ppo_mini_batch_size": mini,
            "ppo_micro_batch_size_per_gpu": args.micro_batch,
            "log_prob_micro_batch_size_per_gpu": args.log_prob_micro_batch,
            "logprob_head": "fused",
            "optim": {"lr": 1e-6},
            "fsdp": trained_fsdp,
            **packing,
            "log_prob_max_token_len_per_gpu": log_prob_budget,
        },
        "ref": {"log_prob_micro_batch_size_per_gpu": args.log_prob_micro_batch, "fsdp": fsdp},
        "critic": {
            "ppo_mini_batch_size": mini,
            "ppo_micro_batch_size_per_gpu": args.micro_batch,
            "forward_micro_batch_size_per_gpu": args.log_prob_micro_batch,
            "optim": {"lr": 1e-5},
            "fsdp": trained_fsdp,
            **packing,
            "forward_max_token_len_per_gpu": log_prob_budget,
        },
        "algorithm": {
            "adv_estimator": "grpo" if grpo else "gae",
            "use_kl_in_reward": not grpo,
            "overlap": args.overlap,
            "rollout_correction": rollout_correction(args),
        },
        "storage": {"root": root, "experiment": "bench"},
        "resources": {
            "nprocs": args.ranks,
            "device": args.device,
            "deterministic": getattr(args, "deterministic", False),
        },
        "checkpoint": {
            "async_save": not args.sync_checkpoints,
            "keep_last": 2,
            **({"snapshot_every": args.snapshot_every} if args.snapshot_every else {}),
            **({"snapshot_at_end": False} if getattr(args, "no_final_snapshot", False) else {}),
        },
    }
    if getattr(args, "lora_rank", 0):  # gpu_check and rollout_cycle build their configs here too
        return with_lora(config, args)
    return config


def rollout_correction(args) -> dict:
    """``algorithm.rollout_correction`` from the flags (the config's defaults where a caller, such as
    gpu_check or rollout_cycle, has none of them)."""
    keys = ("behaviour", "tis", "tis_cap", "mis", "mis_lower", "mis_upper")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def with_lora(config: dict, args) -> dict:
    """``config`` with LoRA adapters of ``--lora-rank`` on the actor and the critic. On GPU the
    frozen base is kept in bfloat16 (no float32 master copy: nothing of it is trained); the adapters
    stay float32 (PEFT), computed in bfloat16 like the full run's parameters."""
    lora = {
        "rank": args.lora_rank,
        "alpha": args.lora_alpha or 2.0 * args.lora_rank,
        "target_modules": "all-linear",
    }
    config["actor"]["lora"] = {**lora, "sync": args.lora_sync}
    config["critic"]["lora"] = dict(lora)
    if args.device == "cuda":
        config["model"]["dtype"] = "bfloat16"
    return config


def batching(args) -> str:
    """How the run's micro-batches were formed, for the table's head."""
    if getattr(args, "minimal", False):
        return "minimal config (model, data, estimator; the rest the defaults)"
    return "packed micro-batches (dynamic bsz)" if args.dynamic_bsz else "padded micro-batches"


def mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def commit_interval(rows: list[dict], before: dict | None) -> float:
    """Mean seconds between consecutive commits (the steady-state time per iteration)."""
    stamps = [
        r["time/committed_unix_s"]
        for r in ([before] if before else []) + rows
        if "time/committed_unix_s" in r
    ]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return sum(gaps) / len(gaps) if gaps else float("nan")


def generation_lines(rows: list[dict]) -> list[str]:
    """Each iteration's generation (the cold one first) with the CPU it got: the decoding thread's CPU
    seconds and how busy the host was (``infra/runtime/host_cpu.py`` says what they can and cannot tell)."""
    parts = []
    for r in rows:
        if "rollout/generate_s" not in r:
            continue
        part = f"{r['rollout/generate_s']:.3f} s"
        if "perf/rollout_thread_cpu_s" in r:
            part += f" (thread CPU {r['perf/rollout_thread_cpu_s']:.3f} s"
            if "perf/rollout_host_busy" in r:
                part += f", host busy {r['perf/rollout_host_busy']:.0%}, stolen {r['perf/rollout_host_steal']:.1%}"
            part += ")"
        parts.append(part)
    return ["generation per iteration (first one cold): " + "; ".join(parts)] if parts else []


def report(
    args, rows: list[dict], n_params: int, extra: list[str] = (), before: dict | None = None
) -> tuple[str, dict]:
    """The table (per task seconds, tokens/s per stage, MFU, share outside compute, checkpoints,
    GPU memory, comparisons) and the run's summary dict. ``before``: the metrics of the iteration
    before ``rows`` (for the interval between commits)."""
    from gpu_report import comparison_lines, load_baseline, memory_lines, summary

    resp_tokens = mean(rows, "response_length/mean") * args.prompts * args.n
    all_tokens = mean(rows, "perf/total_num_tokens")
    interval = commit_interval(rows, before)
    it = interval if interval == interval else mean(rows, "timing_s/iteration")
    engine = args.engine
    if args.engine == "vllm":
        graphs = args.device == "cuda" if args.eager is None else not args.eager
        engine += f" (TP {args.tp}, {'CUDA graphs' if graphs else 'eager'})"
    lines = [
        f"ppoflow iteration benchmark: {args.preset} (N={n_params / 1e6:.1f}M), {args.ranks} rank(s) on "
        f"{args.device}, engine {engine}, {args.prompts} prompts x {args.n}, prompt {args.prompt_len}, "
        f"response {args.response_len} (mean {mean(rows, 'response_length/mean'):.1f}), "
        f"{batching(args)}; "
        f"checkpoints {'sync' if args.sync_checkpoints else 'async'}, snapshot every "
        f"{args.snapshot_every or 'default'}"
        f"{', none at the end' if getattr(args, 'no_final_snapshot', False) else ''}, overlap {args.overlap}, "
        f"{'deterministic' if args.deterministic else 'default'} kernels; "
        f"mean of {len(rows)} warm iteration(s)",
        "",
        f"{'stage':<22}{'seconds':>10}{'tokens/s':>12}",
    ]
    stages = [
        ("generate", "timing_s/generate", resp_tokens),
        ("  of which generation", "rollout/generate_s", resp_tokens),
        ("    in the GC", "rollout/gc_s", None),
        ("  of which old log-prob", "perf/old_log_prob_s", all_tokens),
        ("  of which weight sync", "weight_sync_s", None),
        ("    wake (both tags)", "rollout/wake_s", None),
        ("    push", "rollout/push_s", None),
        ("  of which sleep", "rollout/sleep_s", None),
        ("ref_log_prob", "timing_s/ref_log_prob", all_tokens),
        ("values", "timing_s/values", all_tokens),
        ("advantage", "timing_s/advantage", None),
        ("update_actor", "timing_s/update_actor", all_tokens),
        ("  of which compute", "perf/update_actor_s", all_tokens),
        ("  of which checkpoint", "timing_s/save_checkpoint_actor", None),
        ("  background write", "timing_s/checkpoint_write_actor", None),
        ("update_critic", "timing_s/update_critic", all_tokens),
        ("  of which compute", "perf/update_critic_s", all_tokens),
        ("  of which checkpoint", "timing_s/save_checkpoint_critic", None),
        ("  background write", "timing_s/checkpoint_write_critic", None),
        ("commit", "timing_s/commit", None),
        ("  waiting for checkpoints", "timing_s/commit_wait_checkpoints", None),
        ("iteration (latency)", "timing_s/iteration", None),
        ("iteration (between commits)", None, all_tokens),
    ]
    for name, key, tokens in stages:
        s = mean(rows, key) if key else interval
        if s != s and key and key.startswith("rollout/") and key != "rollout/generate_s":
            continue  # wake/push/sleep exist on GPU only
        tps = f"{tokens / s:12.0f}" if tokens and s == s and s > 0 else f"{'':>12}"
        lines.append(f"{name:<22}{s:10.3f}{tps}")

    def m(key: str) -> float:
        v = mean(rows, key)
        return 0.0 if v != v else v

    # model compute on the critical path: the two reads and the two updates run concurrently
    compute = (
        m("rollout/generate_s")
        + m("perf/old_log_prob_s")
        + max(m("timing_s/ref_log_prob"), m("timing_s/values"))
        + m("timing_s/advantage")
        + max(m("perf/update_actor_s"), m("perf/update_critic_s"))
    )
    lines.append("")
    peak = getattr(args, "peak_tflops", None) or PEAK_TFLOPS.get(args.device)
    if peak:
        upd = mean(rows, "perf/update_actor_s")
        factor = 8 if args.recompute else 6
        mfu = factor * n_params * all_tokens / upd / (peak * 1e12 * args.ranks)
        lines.append(f"actor update MFU ({factor}·N·tokens / {peak:.0f} TFLOP/s): {mfu:.3f}")
    lines.append(
        f"Prefect overhead (iteration wall - critical path of task time): "
        f"{mean(rows, 'timing_s/overhead'):.3f} s"
    )
    outside = max(0.0, it - compute)
    critical = max(m("timing_s/save_checkpoint_actor"), m("timing_s/save_checkpoint_critic"))
    sizes = m("perf/checkpoint_bytes_actor") + m("perf/checkpoint_bytes_critic")
    lines.append(
        f"checkpoint on the critical path: {critical:.3f} s (staging to host memory + waiting for the "
        f"previous write); written in the background: actor {m('timing_s/checkpoint_write_actor'):.3f} s, "
        f"critic {m('timing_s/checkpoint_write_critic'):.3f} s, {sizes / 1e9:.2f} GB per iteration"
    )
    lines.append(
        f"outside model compute (Prefect, Arrow I/O, dispatch, weight sync, checkpoints): "
        f"{outside:.3f} s = {outside / it:.1%} of the iteration "
        f"(weight sync {m('weight_sync_s'):.3f} s, checkpoints "
        f"{max(m('timing_s/save_checkpoint_actor'), m('timing_s/save_checkpoint_critic')):.3f} s on the critical path)"
    )
    stamps = [r.get("time/committed_unix_s") for r in ([before] if before else []) + rows]
    gaps = [
        f"{r['iteration']}: {b - a:.2f} s{' (snapshot)' if 'timing_s/save_checkpoint_actor' in r else ''}"
        for r, a, b in zip(rows, stamps, stamps[1:])
        if a is not None and b is not None
    ]
    if gaps:
        lines.append("between commits, per iteration: " + "; ".join(gaps))
    run = summary(args, rows, mean, resp_tokens, all_tokens)
    run.update(iteration_between_commits_s=interval, checkpoint_critical_path_s=critical)
    more = [*comparison_lines(args, run, load_baseline(args.baseline)), *memory_lines(rows, mean), *extra]
    if more:
        lines += ["", *more]
    return "\n".join(lines), run


def run_once(args, work: str) -> tuple[str, dict, list[dict]]:
    """Build the model and prompts under ``work``, run the flow, return (table, summary, rows)."""
    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.config import parse_config

    model_dir = os.path.join(work, "model")
    data_url = os.path.join(work, "prompts.parquet")
    t0 = time.perf_counter()
    cfg = parse_config(experiment_config(args, model_dir, data_url, os.path.join(work, "runs")))
    done = committed(cfg) if getattr(args, "resume", False) else 0
    if done:  # the model and prompts of the experiment's first sitting, as they are
        n_params = model_params(model_dir)
        print(f"resuming the experiment under {work} after iteration {done}", flush=True)
    else:
        n_params = build_model(
            model_dir, args.preset, args.prompt_len + args.response_len + 8, args.mean_response_len
        )
        build_prompts(data_url, max(args.prompts * (args.iters + 1), args.prompts), args.prompt_len)
    print(
        f"built model ({n_params / 1e6:.1f}M params) and prompts in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    from gpu_report import DeviceMemorySampler

    sampler = DeviceMemorySampler().start() if args.device == "cuda" else None
    t0, start_unix = time.perf_counter(), time.time()
    try:
        ppo(cfg, iterations=max(0, 1 + args.iters - done))
    finally:
        if sampler is not None:
            sampler.stop()
    first = "first one cold" if not done else f"resumed after {done}: iteration {done + 1} cold"
    print(
        f"flow run: {time.perf_counter() - t0:.1f} s for {max(0, 1 + args.iters - done)} iterations ({first})",
        flush=True,
    )
    exp = cfg.storage.experiment_url
    rows = []
    for n in range(1, args.iters + 2):
        with open(os.path.join(exp, "iterations", f"{n:06d}", "metrics.json")) as f:
            rows.append(json.load(f))
    from mismatch_report import mismatch_lines

    extra = [*generation_lines(rows), *(sampler.lines() if sampler else []), *mismatch_lines(rows)]
    text, run = report(args, rows[1:], n_params, extra, before=rows[0])
    run["run_start_unix_s"] = start_unix if not done else None
    run["checkpoint_bytes_actor"] = mean(rows, "perf/checkpoint_bytes_actor")
    run["checkpoint_bytes_critic"] = mean(rows, "perf/checkpoint_bytes_critic")
    for key in (
        "actor_group_resident_gib",
        "update_actor_gib",
        "critic_group_resident_gib",
        "update_critic_gib",
    ):
        run[f"mem_{key}"] = mean(rows[1:], f"perf/mem/{key}")
    return text, run, rows


LORA_ROWS = (
    ("seconds per iteration (between commits)", "iteration_between_commits_s", "{:.2f}"),
    ("seconds per iteration (latency)", "iteration_s", "{:.2f}"),
    ("generation s", "generation_s", "{:.2f}"),
    ("weight sync s", "weight_sync_s", "{:.3f}"),
    ("actor checkpoint MB", "checkpoint_bytes_actor", "MB"),
    ("critic checkpoint MB", "checkpoint_bytes_critic", "MB"),
    ("actor group resident GiB/rank", "mem_actor_group_resident_gib", "{:.2f}"),
    ("actor update peak GiB/rank", "mem_update_actor_gib", "{:.2f}"),
    ("critic group resident GiB/rank", "mem_critic_group_resident_gib", "{:.2f}"),
    ("critic update peak GiB/rank", "mem_update_critic_gib", "{:.2f}"),
)


def lora_table(full: dict, lora: dict, args) -> str:
    """Full fine-tuning and LoRA side by side (a dash where the figure is not measured, e.g. memory on CPU)."""

    def cell(run: dict, key: str, fmt: str) -> str:
        v = run.get(key)
        if v is None or v != v:
            return "-"
        return f"{v / 1e6:.1f}" if fmt == "MB" else fmt.format(v)

    head = f"LoRA rank {args.lora_rank} (sync {args.lora_sync}) vs full fine-tuning"
    lines = [head, f"{'':<42}{'full':>12}{'lora':>12}"]
    for name, key, fmt in LORA_ROWS:
        lines.append(f"{name:<42}{cell(full, key, fmt):>12}{cell(lora, key, fmt):>12}")
    return "\n".join(lines)


def commit_times(run: dict, rows: list[dict]) -> dict:
    """Seconds between commits over the whole run (the first iteration's from the flow run's
    start, the last one's snapshot included): mean, median, and the warm iterations' mean."""
    import statistics

    stamps = [run["run_start_unix_s"]] + [r["time/committed_unix_s"] for r in rows]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "whole_run_mean_s": sum(gaps) / len(gaps),
        "median_s": statistics.median(gaps),
        "warm_mean_s": sum(gaps[1:]) / max(1, len(gaps) - 1),
        "per_iteration_s": [round(g, 2) for g in gaps],
    }


def minimal_table(tuned: dict, minimal: dict) -> str:
    """The tuned and the minimal config side by side, and the minimal one's time over the tuned's."""
    lines = [f"{'seconds between commits':<44}{'tuned':>10}{'minimal':>10}{'ratio':>8}"]
    for name, key in (
        ("whole run, mean (first and last included)", "whole_run_mean_s"),
        ("whole run, median", "median_s"),
        ("warm iterations (2..), mean", "warm_mean_s"),
    ):
        a, b = tuned[key], minimal[key]
        lines.append(f"{name:<44}{a:>10.2f}{b:>10.2f}{b / a:>8.3f}")
    lines.append(f"per iteration, tuned:   {tuned['per_iteration_s']}")
    lines.append(f"per iteration, minimal: {minimal['per_iteration_s']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    work = args.storage or tempfile.mkdtemp(prefix="ppoflow-bench-")
    os.makedirs(work, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", os.path.join(work, "prefect-home"))
    # a fresh PREFECT_HOME migrates its database first: on a busy machine that outlasts the 20 s default
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry (offline)
    from ppoflow.infra.runtime.signals import install_stop_handlers

    install_stop_handlers()
    if args.compare:
        from mismatch_report import compare_runs

        text, run = compare_runs(args, work, run_once)
        rows = []
    elif args.minimal_compare:
        tuned_args = argparse.Namespace(**{**vars(args), "minimal": False})
        tuned_text, tuned_run, tuned_rows = run_once(tuned_args, os.path.join(work, "tuned"))
        print(tuned_text, flush=True)
        min_args = argparse.Namespace(**{**vars(args), "minimal": True})
        text, run, rows = run_once(min_args, os.path.join(work, "minimal"))
        print(text)
        times = commit_times(tuned_run, tuned_rows), commit_times(run, rows)
        table = minimal_table(*times)
        print("\n" + table)
        run = {"tuned": {**tuned_run, **times[0]}, "minimal": {**run, **times[1]}}
        text = tuned_text + "\n\n" + text + "\n\n" + table
    elif args.lora_compare:
        if not args.lora_rank:
            raise SystemExit("--lora-compare needs --lora-rank R")
        full_args = argparse.Namespace(**{**vars(args), "lora_rank": 0})
        full_text, full_run, _ = run_once(full_args, os.path.join(work, "full"))
        print(full_text, flush=True)
        text, run, rows = run_once(args, os.path.join(work, "lora"))
        print(text)
        table = lora_table(full_run, run, args)
        print("\n" + table)
        run = {"full": full_run, "lora": run}
        text = full_text + "\n\n" + text + "\n\n" + table
    else:
        text, run, rows = run_once(args, work)
        print(text)
    print("summary: " + json.dumps(run))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "iteration_bench.txt"), "w") as f:
            f.write(text + "\n\n" + json.dumps(rows, indent=1))
        with open(os.path.join(out, "iteration_bench.json"), "w") as f:
            json.dump({"summary": run, "args": vars(args), "iterations": rows}, f, indent=1)
    if not args.storage and not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
