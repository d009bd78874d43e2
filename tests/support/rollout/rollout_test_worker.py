"""A small worker for the rollout scenarios (tests/support/rollout/vllm_scenario.py) and the multi-turn
rollouts (tests/workers/rollout/test_multiturn.py): an FSDP2 policy + a rollout engine in each rank.

Driven through ``ppoflow.infra.remote.driver.group.WorkerGroup``:

    init_model()                      FSDP2 PolicyLM (tied tiny Qwen2), AdamW, rollout, manager
    perturb(seed)                     one optimizer step on a random-target loss; source := live
    save(url)                         sharded DCP checkpoint of the policy (every rank)
    use_checkpoint(url)               source := checkpoint url
    generate(data, engine=None, **meta)  (DP_COMPUTE_PROTO) rollout inside the manager, then the actor's
                                      old_log_probs of the same rows; metrics in meta_info
    layout()                          tp/dp layout, block size, push stats
    replay(requests)                  single vLLM requests with given seeds (multi-turn reference)

Config keys: model_path, tp, engine ("vllm"/"hf"), also_hf (build an HFRollout on the same module
too; ``generate(..., engine="hf")`` uses it), loader ("hf"/"dtensor"), prompt_length,
response_length, n, temperature, kv_cache_gib, lr, load_format, multi_turn (the rollout section's).
"""

from __future__ import annotations

import torch

from ppoflow.infra.remote.rank.worker import Dispatch, Worker, register
from ppoflow.workers.rollout.episodes import EPISODE_METRIC_RULES


class RolloutTestWorker(Worker):
    """FSDP2 actor + rollout in one rank (the hybrid engine of ActorRolloutRefWorker, minus PPO)."""

    def __init__(self, config: dict):
        super().__init__(config)
        self.module = self.optimizer = self.rollout = self.manager = self.actor = None

    def _experiment_config(self):
        from ppoflow.infra.config import ExperimentConfig

        c = self.config
        return ExperimentConfig.model_validate(
            {
                "model": {"path": c["model_path"], "dtype": "float32"},
                "data": {"train_files": ["unused.parquet"], "train_batch_size": 16},
                "resources": {"nprocs": self.world_size},
                "rollout": {
                    "engine": c.get("engine", "vllm"),
                    "tensor_model_parallel_size": c.get("tp", 1),
                    "prompt_length": c.get("prompt_length", 64),
                    "response_length": c.get("response_length", 8),
                    "n": c.get("n", 1),
                    "temperature": c.get("temperature", 1.0),
                    "kv_cache_gib": c.get("kv_cache_gib", 0.0625),
                    "seed": c.get("seed", 0),
                    "max_num_seqs": c.get("max_num_seqs", "auto"),
                    "calculate_log_probs": c.get("calculate_log_probs", True),
                    "multi_turn": c.get("multi_turn", {}),
                },
                "actor": {  # padded micro-batches: init_model builds a plain (not varlen) module
                    "optim": {"lr": c.get("lr", 0.05), "weight_decay": 0.0},
                    "ppo_mini_batch_size": 16,
                    "log_prob_micro_batch_size_per_gpu": 64,
                    "use_dynamic_bsz": False,
                },
            }
        )

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        from transformers import AutoTokenizer

        from ppoflow.workers.actor import DataParallelPPOActor
        from ppoflow.workers.fsdp_utils import apply_fsdp, build_mesh
        from ppoflow.workers.hf_models import load_hf_model
        from ppoflow.workers.modeling import PolicyLM
        from ppoflow.workers.optim import build_optimizer
        from ppoflow.workers.rollout import build_rollout, build_sharding_manager

        cfg = self.cfg = self._experiment_config()
        torch.manual_seed(0)
        hf = load_hf_model(cfg.model, "causal_lm")
        mesh = build_mesh(cfg.actor.fsdp, self.world_size, "cpu")
        self.module = apply_fsdp(PolicyLM(hf), mesh, cfg.actor.fsdp, "cpu")
        self.optimizer, _ = build_optimizer(self.module, cfg.actor.optim)
        self.actor = DataParallelPPOActor(
            cfg.actor,
            self.module,
            self.optimizer,
            rollout_n=cfg.rollout.n,
            dp_size=self.world_size,
            device="cpu",
            default_temperature=cfg.rollout.temperature,
        )
        tok = AutoTokenizer.from_pretrained(cfg.model.path)
        kw = {"load_format": self.config["load_format"]} if "load_format" in self.config else {}
        self.rollout = build_rollout(
            cfg,
            model_path=cfg.model.path,
            tokenizer=tok,
            actor_module=self.module,
            device="cpu",
            rank=self.rank,
            world_size=self.world_size,
            **kw,
        )
        self.manager = build_sharding_manager(
            self.rollout, self.module, loader=self.config.get("loader", "hf")
        )
        self.engines = {cfg.rollout.engine: (self.rollout, self.manager)}
        if self.config.get("also_hf") and cfg.rollout.engine != "hf":  # the HF rollout on the same module
            hf_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": "hf"})})
            hf = build_rollout(
                hf_cfg,
                model_path=cfg.model.path,
                tokenizer=tok,
                actor_module=self.module,
                device="cpu",
                rank=self.rank,
                world_size=self.world_size,
            )
            self.engines["hf"] = (hf, build_sharding_manager(hf, self.module))
        return self.layout()

    @register(Dispatch.ONE_TO_ALL)
    def layout(self) -> dict:
        r = self.rollout
        return {
            "rank": self.rank,
            "tp_rank": r.tp_rank,
            "tp_size": r.tp_size,
            "dp_rank": r.dp_rank,
            "dp_size": r.dp_size,
            "block_size": getattr(r, "block_size", 0),
            "engine": r.describe() if hasattr(r, "describe") else {},
            "last_push": {
                k: v
                for k, v in getattr(self.manager, "last_push", {}).items()
                if isinstance(v, (int, float, str, list))
            },
        }

    @register(Dispatch.ONE_TO_ALL)
    def perturb(self, seed: int = 1) -> float:
        """One AdamW step towards random next tokens: the weights (tied embedding included) move."""
        self.module.train()
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(5, 200, (4, 24), generator=g)
        resp = ids[:, 12:]
        out = self.module(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(24).expand(4, 24),
            responses=resp,
        )
        loss = -out["log_probs"].mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.module.eval()
        self.manager.set_source_live()
        return float(loss)

    @register(Dispatch.ONE_TO_ALL)
    def save(self, url: str) -> str:
        from ppoflow.infra.checkpoint.sharded import save_checkpoint

        return save_checkpoint(url, self.module)

    @register(Dispatch.ONE_TO_ALL)
    def set_log_probs(self, on: bool) -> None:
        """rollout.calculate_log_probs of the running engine (read at every generate call)."""
        self.cfg.rollout.calculate_log_probs = on
        assert self.rollout.config.calculate_log_probs is on

    @register(Dispatch.ONE_TO_ALL)
    def use_checkpoint(self, url: str) -> None:
        self.manager.set_source_checkpoint(url)

    @register(Dispatch.DP_COMPUTE_PROTO, metrics=EPISODE_METRIC_RULES)
    def generate(self, data, engine: str | None = None, **meta):
        """Rollout (weights pushed on entry if needed) + the actor's old_log_probs of its rows."""
        rollout, manager = self.engines[engine or self.cfg.rollout.engine]
        data.meta_info.update(meta)
        with manager:
            out = rollout.generate_sequences(data)
        old, _ = self.actor.compute_log_prob(out)
        out.batch["old_log_probs"] = old
        out.meta_info["metrics"]["weight_sync_s"] = manager.last_sync_s
        out.meta_info["metrics"]["rank"] = self.rank
        return out

    @register(Dispatch.ONE_TO_ALL)
    def replay(self, requests: list[dict]) -> list[list[int]]:
        """Sample each ``{"context", "seed", "max_tokens", "temperature"}`` request alone, straight
        from this rank's vLLM engine (the reference of the multi-turn tests)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rollout, manager = self.engines["vllm"]
        llm = getattr(rollout, "engine", rollout).llm
        outs = []
        with manager:
            for r in requests:
                params = SamplingParams(
                    temperature=r["temperature"], max_tokens=r["max_tokens"], seed=r["seed"], detokenize=False
                )
                out = llm.generate([TokensPrompt(prompt_token_ids=r["context"])], params, use_tqdm=False)
                outs.append(list(out[0].outputs[0].token_ids))
        return outs

    def shutdown(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()  # keeps the vLLM engine (see VLLMRollout.shutdown)
        self.module = self.optimizer = self.actor = None
