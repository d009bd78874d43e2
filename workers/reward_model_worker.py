"""RewardModelWorker: scores rollouts with a sequence-classification reward model.

Config given to the group: ``{"config": ExperimentConfig as JSON dict (or string), "role": "reward_model"}``;
the model is ``reward.reward_model.model`` (an HF ``*ForSequenceClassification`` with one label).

The driver calls its ``@register`` methods as ``RewardModelContract`` says
(``ppoflow.infra.remote.contracts``): ``init_model``, ``compute_rm_score`` -> "rm_scores" (B, R) float32.

The score of a (prompt, response) is the head's output at the last token of the response; it is
written at the last valid response position (the last 1 of ``response_mask``, position 0 for an empty
response: ``ppoflow.infra.rewards.rollout_batch.on_last_token``) and every other position is 0.

Tokenizers: when the reward model's tokenizer equals the policy's (same name, or same vocabulary,
special tokens and chat template) the rollout's ``input_ids`` are scored as they are. Otherwise
each row is decoded to text and re-encoded with the reward model's tokenizer: the conversation is
the row's ``raw_prompt`` (chat messages or a string) or else the decoded prompt as one user
message, followed by the decoded response as the assistant message, rendered with the RM's chat
template when it has one (else prompt text + response text), and cut to
``reward.reward_model.max_length`` tokens from the right (the end is dropped; the score is taken
at the last kept token), as veRL does. Rows are scored in micro-batches of
``reward.reward_model.micro_batch_size_per_gpu``, or with ``use_dynamic_bsz`` in packed
micro-batches of at most ``forward_max_token_len_per_gpu`` real tokens (no compute on padding).
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.remote.contracts import REWARD_MODEL_ROLE
from ppoflow.infra.remote.rank.worker import Dispatch, Worker, register
from ppoflow.infra.rewards.rollout_batch import decode_responses, on_last_token
from ppoflow.workers.device_memory import release_cached
from ppoflow.workers.fsdp_utils import apply_fsdp, build_mesh, mesh_info, reshard_all
from ppoflow.workers.hf_models import load_hf_model
from ppoflow.workers.modeling import HFRoot, base_hidden, one_label
from ppoflow.workers.packing import (
    checked_index,
    pack,
    packed_hidden,
    token_budget_micro_batches,
    use_varlen_attention,
)
from ppoflow.workers.worker_setup import parse_worker_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["RewardModelWorker", "LastTokenScorer", "same_tokenizer"]


class LastTokenScorer(HFRoot):
    """Wraps an HF sequence-classification model: base model + ``score`` head applied to the hidden
    state of one chosen token per row. Parameter names stay the HF names."""

    def __init__(self, hf_model: PreTrainedModel):
        one_label(hf_model, "a reward model")
        if not isinstance(getattr(hf_model, "score", None), nn.Module):
            raise ValueError(
                f"{type(hf_model).__name__} has no `score` head; use an HF *ForSequenceClassification "
                "model (Llama, Qwen2, Mistral, ...) as the reward model"
            )
        super().__init__(hf_model)
        self.score = cast(nn.Module, hf_model.score)  # checked above

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        last_index: torch.Tensor,
        packed: bool = False,
    ) -> torch.Tensor:
        """(B,) float32 score at ``last_index`` (B,) of each row (``packed``: the model runs on the
        real tokens only; needs ``use_varlen_attention`` on the HF model)."""
        if packed:
            rows = pack(input_ids, attention_mask, position_ids)
            at = rows.index[torch.arange(len(last_index), device=last_index.device), last_index]
            picked = packed_hidden(self.base, rows)[checked_index(at, "the scored last token")]
            return self.score(picked).squeeze(-1).float()
        hidden = base_hidden(self.base, input_ids, attention_mask, position_ids)
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_index]
        return self.score(picked).squeeze(-1).float()


def same_tokenizer(a: Any, b: Any) -> bool:
    """True when token ids of ``a`` mean the same to ``b`` and the chat format is the same."""
    if a is b:
        return True
    return (
        a.get_vocab() == b.get_vocab()
        and a.all_special_tokens == b.all_special_tokens
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
    )


class RewardModelWorker(Worker):
    """FSDP reward model in eval mode (no optimizer) on the ranks of one group."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self.cfg, self.role = parse_worker_config(
            config, REWARD_MODEL_ROLE.modes, REWARD_MODEL_ROLE.default.wire
        )
        self.rm_cfg = self.cfg.reward.reward_model
        if self.rm_cfg.model is None:
            raise ValueError(
                "RewardModelWorker needs reward.reward_model.model.path (a sequence-classification model)"
            )
        self.module: LastTokenScorer | None = None
        self.rm_tokenizer: Any = None
        self.policy_tokenizer: Any = None
        self.same_tokenizer = True

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load both tokenizers and the reward model on every rank, shard it with FSDP, eval mode."""
        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        model_cfg = self.rm_cfg.model
        assert model_cfg is not None  # checked in __init__
        self.rm_tokenizer = AutoTokenizer.from_pretrained(
            model_cfg.tokenizer, trust_remote_code=model_cfg.trust_remote_code
        )
        if model_cfg.tokenizer == self.cfg.model.tokenizer:
            self.policy_tokenizer = self.rm_tokenizer
        else:
            self.policy_tokenizer = AutoTokenizer.from_pretrained(
                self.cfg.model.tokenizer, trust_remote_code=self.cfg.model.trust_remote_code
            )
        self.same_tokenizer = same_tokenizer(self.policy_tokenizer, self.rm_tokenizer)
        torch.manual_seed(self.cfg.seed)
        hf = load_hf_model(model_cfg, "sequence_classification")
        if self.rm_cfg.use_dynamic_bsz:
            use_varlen_attention(hf)
        module = LastTokenScorer(hf)
        mesh = build_mesh(self.rm_cfg.fsdp, self.world_size, self.device.type)
        apply_fsdp(module, mesh, self.rm_cfg.fsdp, self.device)
        module.eval()
        module.requires_grad_(False)
        self.module = module
        return {
            "rank": self.rank,
            "role": "reward_model",
            "reward_model": mesh_info(mesh, module),
            "same_tokenizer": self.same_tokenizer,
            "init_s": round(time.perf_counter() - t0, 3),
        }

    # ------------------------------------------------------------------ inputs
    def _pad_id(self) -> int:
        tok = self.rm_tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return int(pad) if pad is not None else 0

    def _conversation(self, data: DataProto, i: int, response_text: str) -> list[int]:
        """RM token ids of row ``i``: its prompt and the decoded response, in the RM's format."""
        raw = data.non_tensor_batch.get("raw_prompt")
        prompt = raw[i] if raw is not None else None
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        else:
            if not isinstance(prompt, str):
                p_len = data.batch["prompts"].shape[1]
                row, mask = data.batch["prompts"][i], data.batch["attention_mask"][i, :p_len].bool()
                prompt = self.policy_tokenizer.decode(row[mask].tolist(), skip_special_tokens=True)
            messages = [{"role": "user", "content": prompt}]
        tok = self.rm_tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                messages + [{"role": "assistant", "content": response_text}], tokenize=False
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok("\n".join(str(m["content"]) for m in messages) + response_text)["input_ids"]
        if self.rm_cfg.max_length is not None:
            ids = ids[: self.rm_cfg.max_length]
        return ids or [self._pad_id()]

    def _reencoded(self, data: DataProto, response_mask: torch.Tensor) -> list[list[int]]:
        texts = decode_responses(data, self.policy_tokenizer, response_mask)
        return [self._conversation(data, i, text) for i, text in enumerate(texts)]

    def _row_groups(self, lengths: list[int]) -> list[list[int]]:
        """Rows of each micro-batch: ``micro_batch_size_per_gpu`` consecutive rows, or with
        ``use_dynamic_bsz`` groups of at most ``forward_max_token_len_per_gpu`` real tokens (the same
        number of groups on every rank)."""
        if not self.rm_cfg.use_dynamic_bsz:
            mb = self.rm_cfg.micro_batch_size_per_gpu
            return [list(range(s, min(s + mb, len(lengths)))) for s in range(0, len(lengths), mb)]
        groups = token_budget_micro_batches(
            torch.tensor(lengths, dtype=torch.long),
            self.rm_cfg.forward_max_token_len_per_gpu,
            self.device,
            "reward.reward_model.forward_max_token_len_per_gpu",
        )
        return [g.tolist() for g in groups]

    def _micro_batches(self, data: DataProto, response_mask: torch.Tensor):
        """Yield (rows, input_ids, attention_mask, position_ids, last_index) per micro-batch."""
        if self.same_tokenizer:
            ids, attn, pos = (data.batch[k] for k in ("input_ids", "attention_mask", "position_ids"))
            for rows in self._row_groups(attn.sum(-1).tolist()):
                a = attn[rows]
                cols = torch.nonzero(a.sum(0)).flatten()
                lo, hi = (int(cols[0]), int(cols[-1]) + 1) if len(cols) else (0, a.shape[1])
                a = a[:, lo:hi]
                last = (a * torch.arange(a.shape[1])).argmax(-1)
                yield rows, ids[rows, lo:hi], a, pos[rows, lo:hi], last
            return
        seqs = self._reencoded(data, response_mask)
        pad = self._pad_id()
        for rows in self._row_groups([len(x) for x in seqs]):
            chunk = [seqs[i] for i in rows]
            width = max(len(x) for x in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attn = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, x in enumerate(chunk):
                ids[j, : len(x)] = torch.tensor(x, dtype=torch.long)
                attn[j, : len(x)] = 1
            pos = torch.arange(width).expand(len(chunk), width).contiguous()
            yield rows, ids, attn, pos, torch.tensor([len(x) - 1 for x in chunk])

    # ------------------------------------------------------------------ scoring
    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B, R) float32: the RM score at the last valid response token, 0 elsewhere."""
        if self.module is None:
            raise RuntimeError("init_model was not called")
        n, r = data.batch["responses"].shape
        mask = data.batch.get("response_mask")
        if mask is None:
            mask = data.batch["attention_mask"][:, -r:]
        scores = torch.zeros(n, dtype=torch.float32)
        packed = self.rm_cfg.use_dynamic_bsz
        with torch.no_grad():
            for rows, ids, attn, pos, last in self._micro_batches(data, mask):
                dev = self.device
                score = self.module(ids.to(dev), attn.to(dev), pos.to(dev), last.to(dev), packed=packed)
                scores[rows] = score.float().cpu()
        reshard_all(self.module)
        release_cached(self.device)  # the next rollout's engine maps its memory on this GPU
        # on the last position where the mask is 1: the end of a response, or of a multi-turn
        # episode's last policy turn (its mask has gaps); 0 for an empty one
        return DataProto.from_dict({"rm_scores": on_last_token(scores, mask)})

    def shutdown(self) -> None:
        """Drop the FSDP module before the process group goes away."""
        self.module = None
        gc.collect()
