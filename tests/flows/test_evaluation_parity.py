"""Evaluation agrees with itself: the held-out score training committed for iteration n, ``ppoflow
eval --iteration n`` and ``ppoflow eval --model <ppoflow export-hf of n>`` give the same responses,
scores and ``val/score`` on the same rows, exactly (a tiny policy, 2 CPU ranks, vLLM's CPU engine
in float32, greedy, the real ``ppo`` flow, then the command line in this process).

The run renders its prompts with a tokenizer of its own (``model.tokenizer_path``) whose chat
template adds a system turn, as SmolLM2's does: an export that took the base model's tokenizer
would ask the exported model other prompts. ``eval --iteration`` is given a copy of the held-out
file: on ``data.val_files`` themselves it finds training's evaluation (same ``spec.json``) and
returns it without generating. Exact equality holds because all three run the same engine, in the
same dtype, on the same batches of the same prompt tokens; what an evaluation outside ppoflow must
match to agree is in docs/evaluation.md."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from ppoflow.cli.main import main
from ppoflow.infra.experiment.manifest import ExperimentPaths
from tests.support.configs import LIGHT

pytestmark = pytest.mark.slow

N, PROMPTS = 1, 6
#: The run's chat template: a system turn before the user's (byte-level tokens, 7 of them).
TEMPLATE = (
    "<|system|>digits{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _cli(capsys, *argv: str) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _generations(out_dir: str) -> dict[str, list]:
    with pa.OSFile(os.path.join(out_dir, "generations.arrow")) as f:
        return pyarrow.ipc.open_file(f).read_all().to_pydict()


def _evaluation(out: str) -> tuple[dict[str, list], dict, dict]:
    """The generations, metrics and spec of the evaluation ``ppoflow eval`` printed."""
    line = next(x for x in out.splitlines() if x.startswith("responses and scores: "))
    out_dir = os.path.dirname(line.removeprefix("responses and scores: "))
    with open(os.path.join(out_dir, "metrics.json")) as f, open(os.path.join(out_dir, "spec.json")) as g:
        return _generations(out_dir), json.load(f), json.load(g)


def _rendered(tokenizer_dir: str, prompts: list[list[dict]]) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]


def test_training_eval_iteration_and_eval_model_of_the_export_agree(
    prefect_harness, flow_config, tmp_path, capsys
):
    from transformers import AutoTokenizer

    from ppoflow.demo.tiny_models import save_tiny_model
    from ppoflow.flows.ppo import ppo

    # larger random weights than the shared tiny policy's: its greedy answers (one special token,
    # repeated) would make every evaluation agree trivially; these differ from prompt to prompt
    policy = save_tiny_model(str(tmp_path / "policy"), seed=0, initializer_range=0.2)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(tmp_path / "tokenizer"))
    prompts = [[{"role": "user", "content": f"{i * 7}-{i}="}] for i in range(PROMPTS)]
    rows = [
        {"data_source": "openai/gsm8k", "prompt": p, "reward_model": {"ground_truth": "0", "style": "rule"}}
        for p in prompts
    ]
    val = str(tmp_path / "val.parquet")
    pq.write_table(pa.Table.from_pylist(rows), val)
    run_prompts = _rendered(str(tmp_path / "tokenizer"), prompts)
    assert run_prompts != _rendered(policy, prompts)  # the run's own template

    cfg = flow_config(
        str(tmp_path / "runs"),
        "parity",
        **LIGHT,
        **{
            "model.path": policy,
            "model.tokenizer_path": str(tmp_path / "tokenizer"),
            "data.val_files": [val],
            "evaluation.before_training": False,
            "evaluation.every": 0,  # the run's last iteration only (evaluation.at_end)
            "reward.custom_function": "tests.support.rewards:digit_share",
        },
    )
    ppo(cfg, iterations=N)
    url = ExperimentPaths.of(cfg).root
    trained_dir = os.path.join(url, "iterations", f"{N:06d}", "eval", "val")
    trained = _generations(trained_dir)
    with open(os.path.join(url, "iterations", f"{N:06d}", "metrics.json")) as f:
        committed = json.load(f)["val/score"]
    with open(os.path.join(trained_dir, "spec.json")) as f:
        trained_spec = json.load(f)
    assert len(trained["response"]) == PROMPTS and len(set(trained["response"])) > 1

    copy = str(tmp_path / "val-copy.parquet")
    shutil.copyfile(val, copy)
    again, again_metrics, _ = _evaluation(_cli(capsys, "eval", url, "--iteration", str(N), "--files", copy))

    export = str(tmp_path / f"hf-{N}")
    _cli(capsys, "export-hf", url, export, "--iteration", str(N))
    assert _rendered(export, prompts) == run_prompts  # the export asks what training asked
    printed = _cli(capsys, "eval", url, "--model", export)
    assert (
        "decoding: vllm in float32, greedy, up to 8 new tokens, prompts through the tokenizer's chat template"
        in printed
    )
    exported, exported_metrics, exported_spec = _evaluation(printed)
    assert exported_spec["source"] == export and exported_spec["files"] == trained_spec["files"]
    assert exported_spec["rollout"] == trained_spec["rollout"]  # the same engine settings and dtype

    for got, metrics in ((again, again_metrics), (exported, exported_metrics)):
        assert got["prompt"] == trained["prompt"]
        assert got["response"] == trained["response"]
        assert got["score"] == trained["score"]
        assert metrics["val/score"] == committed
