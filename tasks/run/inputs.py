"""What a flow run reads once and every task shares: the policy's tokenizer and the prompt dataset."""

from __future__ import annotations

import threading
from typing import Any

from ppoflow.infra.config import ExperimentConfig

__all__ = ["RunInputs"]


class RunInputs:
    """The run's tokenizer and datasets, loaded on first use (thread-safe: tasks run concurrently)."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self._dataset: Any = None
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

    @property
    def dataset(self) -> Any:
        """The prompt dataset (read once per run; overlong prompts dropped when the config says so)."""
        with self._mutex:
            if self._dataset is None:
                from ppoflow.infra.data.prompts import PromptDataset

                data = self.cfg.data
                dataset = PromptDataset(
                    data.train_files,
                    prompt_key=data.prompt_key,
                    require_ground_truth=self.cfg.reward.rule,
                    storage_options=self.cfg.storage.storage_options or None,
                )
                if data.filter_overlong_prompts:
                    dataset.filter_overlong(
                        self._load_tokenizer(),
                        prompt_length=self.cfg.rollout.prompt_length,
                        apply_chat_template=data.apply_chat_template,
                    )
                self._dataset = dataset
            return self._dataset

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
