"""Held-out evaluation results: the metrics of one evaluation and where it is kept.

An evaluation of iteration ``n`` generates responses to the rows of ``data.val_files`` with the
weights of checkpoint n (``n`` responses per prompt: ``evaluation.n``), scores each with the
reward functions, and is kept beside the iteration::

    iterations/000012/eval/<tag>/generations.arrow   one row per response: prompt, response,
                                                      score, data_source, index, sample, length
    iterations/000012/eval/<tag>/metrics.json         the metrics below

``tag`` is ``val`` for ``data.val_files`` (what training evaluates) and ``files-<hash>`` for other
files (``ppoflow eval --files``). Metrics, per data source ``ds`` and over all rows (``k`` is
``evaluation.n``)::

    val/score                          mean score of every response (the headline)
    val/<ds>/score/mean@<k>            mean over prompts of the mean score of its k responses
    val/<ds>/score/best@<k>            mean over prompts of its best response's score (k > 1)
    val/<ds>/pass@<k>                  share of prompts with a response >= pass_threshold (k > 1)
    val/<ds>/response_length/mean      tokens per response
    val/prompts, val/responses

(veRL's ``val-core/<ds>/reward/mean@k`` is ``val/<ds>/score/mean@k`` here.)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

__all__ = ["EVAL_DIR", "VAL_TAG", "eval_tag", "evaluation_metrics"]

#: The evaluations of iteration n live in ``iterations/n/<EVAL_DIR>/<tag>/``.
EVAL_DIR = "eval"
#: The tag of the config's ``data.val_files``.
VAL_TAG = "val"


def eval_tag(files: Sequence[str], val_files: Sequence[str]) -> str:
    """``val`` for the config's validation files, else ``files-<hash of the file list>``: a name
    by ``ppoflow.infra.config.names.NAME_PATTERN`` whatever the files are called (never a path)."""
    if list(files) == list(val_files):
        return VAL_TAG
    digest = hashlib.sha256(json.dumps(list(files)).encode()).hexdigest()[:10]
    return f"files-{digest}"


def evaluation_metrics(
    prompt_index: Sequence[int],
    data_sources: Sequence[str],
    scores: Sequence[float],
    lengths: Sequence[int],
    n: int,
    pass_threshold: float,
) -> dict[str, float]:
    """The metrics of one evaluation (module docstring) from its responses, one entry each:
    ``prompt_index`` (which prompt a response answers), its data source, score and length."""
    by_prompt: dict[int, list[float]] = {}
    source_of: dict[int, str] = {}
    for i, ds, score in zip(prompt_index, data_sources, scores):
        by_prompt.setdefault(int(i), []).append(float(score))
        source_of[int(i)] = str(ds)
    out: dict[str, float] = {
        "val/score": sum(map(float, scores)) / max(1, len(scores)),
        "val/prompts": float(len(by_prompt)),
        "val/responses": float(len(scores)),
    }
    groups: dict[str, list[int]] = {}
    for i in by_prompt:
        groups.setdefault(source_of[i], []).append(i)
    if n > 1 and by_prompt:
        out[f"val/best@{n}"] = _mean(max(by_prompt[i]) for i in by_prompt)
        out[f"val/pass@{n}"] = _mean(float(max(by_prompt[i]) >= pass_threshold) for i in by_prompt)
    for ds, prompts in sorted(groups.items()):
        out[f"val/{ds}/score/mean@{n}"] = _mean(_mean(by_prompt[i]) for i in prompts)
        if n > 1:
            out[f"val/{ds}/score/best@{n}"] = _mean(max(by_prompt[i]) for i in prompts)
            out[f"val/{ds}/pass@{n}"] = _mean(float(max(by_prompt[i]) >= pass_threshold) for i in prompts)
        ds_lengths = [float(length) for d, length in zip(data_sources, lengths) if str(d) == ds]
        out[f"val/{ds}/response_length/mean"] = _mean(ds_lengths)
    return out


def _mean(values: Iterable[float]) -> float:
    items = [float(v) for v in values]
    return sum(items) / len(items) if items else 0.0
