"""What a flow run reads once and every task shares: the policy's tokenizer and the prompt dataset,
the prompt batch at a data cursor, and the sampling seed of an iteration (what ``generate`` and,
with asynchronous training, the producer's and the trainer's ``consume`` agree on)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ppoflow.infra.config import ExperimentConfig

__all__ = ["RunInputs", "iteration_seed", "round_seed"]


def iteration_seed(seed: int, rollout_seed: int, n: int) -> int:
    """The sampling seed of iteration ``n``: a function of the config's seeds and ``n`` only."""
    return int(np.random.SeedSequence([int(seed), int(rollout_seed), int(n)]).generate_state(1)[0] >> 1)


def round_seed(seed: int, rollout_seed: int, n: int, round_: int) -> int:
    """The sampling seed of dynamic-sampling round ``round_`` of iteration ``n`` (round 0 is the
    iteration's own seed, so one round samples exactly what generation without it does)."""
    if round_ == 0:
        return iteration_seed(seed, rollout_seed, n)
    words = [int(seed), int(rollout_seed), int(n), int(round_)]
    return int(np.random.SeedSequence(words).generate_state(1)[0] >> 1)


class RunInputs:
    """The run's tokenizer and datasets, loaded on first use (thread-safe: tasks run concurrently)."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self._dataset: Any = None
        self._stream: Any = None
        self._val: dict[tuple[str, ...], Any] = {}
        self._tokenizer: Any = None
        self._mutex = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer (loaded once per run)."""
        with self._mutex:
            return self._load_tokenizer()

    def _load_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                self.cfg.model.tokenizer, trust_remote_code=self.cfg.model.trust_remote_code
            )
        return self._tokenizer

    def open_stream(self, root: str, run_key: str, manifest: Any) -> Any:
        """Resolve the run's training files after ``manifest`` (read, checked against what the
        experiment read before, recorded for retries: :func:`ppoflow.infra.data.stream.open_stream`);
        the dataset is then the stream's. Returns the :class:`~ppoflow.infra.data.stream.DataStream`."""
        from ppoflow.infra.data.stream import open_stream

        with self._mutex:
            tokenizer = self._load_tokenizer() if self.cfg.data.filter_overlong_prompts else None
            stream = open_stream(self.cfg, root, run_key, manifest.iteration, manifest.data_files, tokenizer)
            self._stream, self._dataset = stream, stream.dataset
            return stream

    @property
    def data_files(self) -> list[dict[str, Any]] | None:
        """The records of the run's training files (None: no stream was opened)."""
        return None if self._stream is None else self._stream.records

    @property
    def dataset(self) -> Any:
        """The prompt dataset (read once per run; overlong prompts dropped when the config says so)."""
        with self._mutex:
            if self._dataset is None:
                from ppoflow.infra.data.prompts import PromptDataset
                from ppoflow.infra.data.stream import expand_train_files

                data, options = self.cfg.data, self.cfg.storage.storage_options or None
                dataset = PromptDataset(
                    expand_train_files(data.train_files, options),
                    prompt_key=data.prompt_key,
                    require_ground_truth=self.cfg.reward.rule,
                    storage_options=options,
                )
                if data.filter_overlong_prompts:
                    dataset.filter_overlong(
                        self._load_tokenizer(),
                        prompt_length=self.cfg.rollout.prompt_length,
                        apply_chat_template=data.apply_chat_template,
                    )
                self._dataset = dataset
            return self._dataset

    def write_prompts(self, cursor: Any, meta_info: dict[str, Any], url: str) -> tuple[Any, Any, int]:
        """Tokenize the ``data.train_batch_size`` prompts at ``cursor`` (``meta_info`` in the
        batch's) and write them at ``url``: (the prompt batch, the cursor after it, how many prompts
        were truncated)."""
        cfg = self.cfg
        rows, next_cursor = self.dataset.take(
            cursor, cfg.data.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle
        )
        prompts, stats = self.dataset.tokenize(
            rows,
            self.tokenizer,
            prompt_length=cfg.rollout.prompt_length,
            apply_chat_template=cfg.data.apply_chat_template,
            meta_info=meta_info,
            truncation=cfg.data.truncation,
        )
        prompts.save(url)
        return prompts, next_cursor, int(stats["truncated"])

    def val_dataset(self, files: list[str]) -> Any:
        """The held-out prompts of ``files`` (read once per run; every row is kept: an evaluation
        reads its rows in file order, overlong prompts cut by ``data.truncation``)."""
        from ppoflow.infra.data.prompts import PromptDataset

        key = tuple(files)
        with self._mutex:
            if key not in self._val:
                self._val[key] = PromptDataset(
                    list(files),
                    prompt_key=self.cfg.data.prompt_key,
                    require_ground_truth=self.cfg.reward.rule,
                    storage_options=self.cfg.storage.storage_options or None,
                    role="data.val_files",
                )
            return self._val[key]
