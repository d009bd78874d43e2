"""The rows of one batch being sampled in chunks (``asynchronous.max_staleness`` >= 1).

Row ``i`` of a batch is sample ``i % n`` of prompt ``i // n`` (the order of the synchronous
rollout). :class:`InFlight` keeps, for each row still to sample, the tokens it has, their sampler
log-probs and the policy version that sampled each, and builds the next engine call's prompts: the
prompt followed by the row's tokens so far, asking for at most ``chunk_tokens`` more. After a
call it takes the new tokens in (:meth:`InFlight.absorb`): a row is finished when the engine
stopped before the budget, ended on an end-of-sequence token, or filled the response length.

When a newer policy version is loaded between two calls the unfinished rows either continue under
it (partial rollouts: their next tokens carry the new version) or are aborted and sampled again
from their prompt (:meth:`InFlight.requeue`; the tokens they had are counted as requeued). A row
is only ever aborted for a newer version, and batch n admits no version past n - 1, so a row is
requeued at most ``max_staleness`` times and its last attempt runs to the end: a long, hard prompt
is never starved nor dropped (docs/async.md).

:meth:`InFlight.part` turns finished rows into the batch's columns, as the engine's own rollout
has them (``responses``, ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``,
``rollout_log_probs``), plus ``token_versions`` and the row index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ppoflow.infra.data.dataproto import DataProto

__all__ = ["InFlight", "RowState"]

_SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "do_sample", "response_length", "metrics")


@dataclass
class RowState:
    """One row being sampled: its tokens, their log-probs and versions, whether it is finished,
    and how many times it was aborted."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    aborts: int = 0


class InFlight:
    """The rows ``rows`` of a batch of ``prompts`` (B prompts, ``samples`` rows each) being sampled
    (module docstring). ``stop_ids``: the tokens that end a response; ``sampling``: the batch's
    sampling settings as the engine reports them (``n``, ``temperature``, ...)."""

    def __init__(
        self,
        prompts: DataProto,
        samples: int,
        response_length: int,
        rows: list[int],
        stop_ids: list[int],
        sampling: dict[str, Any],
    ):
        self.prompts, self.samples, self.length = prompts, samples, response_length
        self.stop_ids = set(stop_ids)
        self.sampling = dict(sampling)
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
        self._prompt_tokens = [row[m].tolist() for row, m in zip(ids, mask)]
        self.rows = {i: RowState() for i in rows}

    def unfinished(self) -> list[int]:
        return [i for i, r in self.rows.items() if not r.finished]

    def calls(self, chunk_tokens: int) -> dict[int, list[int]]:
        """The unfinished rows grouped by how many new tokens their next call may ask for."""
        groups: dict[int, list[int]] = {}
        for i in self.unfinished():
            budget = min(chunk_tokens, self.length - len(self.rows[i].tokens))
            groups.setdefault(budget, []).append(i)
        return groups

    def contexts(self, rows: list[int], meta_info: dict[str, Any]) -> DataProto:
        """The prompts of the next call for ``rows``: each row's prompt and its tokens so far,
        left-padded (``meta_info``: the call's sampling settings, e.g. ``response_length``, ``n`` 1)."""
        seqs = [self._prompt_tokens[i // self.samples] + self.rows[i].tokens for i in rows]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for j, seq in enumerate(seqs):
            ids[j, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
            mask[j, width - len(seq) :] = 1
        return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, meta_info=meta_info)

    def absorb(self, rows: list[int], out: DataProto, budget: int, version: int) -> None:
        """Take in a call's output for ``rows`` (``responses``, ``response_mask``,
        ``rollout_log_probs``), sampled by ``version`` with at most ``budget`` new tokens each."""
        got, mask = out.batch["responses"], out.batch["response_mask"].bool()
        lps = out.batch["rollout_log_probs"]
        for j, i in enumerate(rows):
            new = got[j][mask[j]].tolist()
            state = self.rows[i]
            state.tokens += new
            state.log_probs += lps[j][mask[j]].tolist()
            state.versions += [version] * len(new)
            ended = bool(new) and new[-1] in self.stop_ids
            state.finished = len(new) < budget or ended or len(state.tokens) >= self.length

    def requeue(self, version: int) -> int:
        """Abort the unfinished rows that hold tokens of a version older than ``version``: they are
        sampled again from their prompt. Returns how many tokens were thrown away."""
        dropped = 0
        for state in self.rows.values():
            if not state.finished and state.tokens and min(state.versions) < version:
                dropped += len(state.tokens)
                state.tokens, state.log_probs, state.versions = [], [], []
                state.aborts += 1
        return dropped

    def take_finished(self) -> DataProto | None:
        """The finished rows as a part of the batch (removed from here), or None when none is."""
        done = sorted(i for i, r in self.rows.items() if r.finished)
        if not done:
            return None
        part = self.part(done)
        for i in done:
            del self.rows[i]
        return part

    def part(self, rows: list[int]) -> DataProto:
        """``rows`` (finished) as the batch's columns (module docstring), in the given order."""
        prompt_of = torch.as_tensor([i // self.samples for i in rows], dtype=torch.long)
        p = self.prompts.batch
        prompt_ids, prompt_mask = p["input_ids"][prompt_of].long(), p["attention_mask"][prompt_of]
        pos = p.get("position_ids")
        pos = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0) if pos is None else pos[prompt_of]
        width = self.length
        resp = torch.zeros((len(rows), width), dtype=torch.long)
        resp_mask = torch.zeros((len(rows), width), dtype=torch.long)
        lp = torch.zeros((len(rows), width), dtype=torch.float32)
        versions = torch.full((len(rows), width), -1, dtype=torch.int32)
        for j, i in enumerate(rows):
            s = self.rows[i]
            k = len(s.tokens)
            resp[j, :k] = torch.as_tensor(s.tokens, dtype=torch.long)
            resp_mask[j, :k] = 1
            lp[j, :k] = torch.as_tensor(s.log_probs, dtype=torch.float32)
            versions[j, :k] = torch.as_tensor(s.versions, dtype=torch.int32)
        tensors = {
            "prompts": prompt_ids,
            "responses": resp,
            "input_ids": torch.cat([prompt_ids, resp], dim=1),
            "attention_mask": torch.cat([prompt_mask, resp_mask.to(prompt_mask.dtype)], dim=1),
            "position_ids": torch.cat(
                [pos, pos[:, -1:] + torch.arange(1, width + 1, dtype=pos.dtype)], dim=1
            ),
            "response_mask": resp_mask,
            "rollout_log_probs": lp,
            "token_versions": versions,
            "row": torch.as_tensor(rows, dtype=torch.long),
        }
        index = prompt_of.numpy()
        non_tensors = {k: np.asarray(v)[index] for k, v in self.prompts.non_tensor_batch.items()}
        meta = {k: v for k, v in self.prompts.meta_info.items() if k not in _SAMPLING_KEYS}
        return DataProto.from_dict(tensors, non_tensors, {**meta, **self.sampling})
