"""The demo's code path end to end at a small size: build, warm start, 2 PPO iterations, artifacts.

The ``demo`` fixture (tests/conftest.py) runs :func:`ppoflow.cli.demo.run_demo` once per session
(tests/flows/test_cli.py uses it too): the same builders, config and flow as ``ppoflow demo``, with fewer prompts, samples and
warm-start steps. Whether PPO *learns* is checked by running the demo itself, not here.
"""

from __future__ import annotations

import io
import os
import random

import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from ppoflow.demo import task as demo_task
from ppoflow.demo.experiment import prepare
from ppoflow.demo.sft import SFTConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.metrics import headline_line
from tests.support.small_demo import SMALL

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ARROW_FILES = ("prompts", "rollout", "ref_log_prob", "values", "advantages")
METRIC_KEYS = (
    "critic/score/mean",
    "critic/rewards/mean",
    "actor/reward_kl_penalty",
    "actor/entropy",
    "response_length/mean",
    "critic/vf_loss",
    "actor/pg_loss",
    "timing_s/iteration",
)
# ------------------------------------------------------------------------------ fast unit tests


def test_task_rule_and_rows():
    assert demo_task.score(demo_task.DATA_SOURCE, "7", "7", None) == 1.0
    assert demo_task.score(demo_task.DATA_SOURCE, " 7 ", "7", None) == 1.0
    for wrong in ("8", "77", "7a", "", "seven", "7 8"):
        assert demo_task.score(demo_task.DATA_SOURCE, wrong, "7", None) == 0.0
    from ppoflow.infra.rewards import get_reward_fn

    assert get_reward_fn(demo_task.DATA_SOURCE) is demo_task.score
    rows = demo_task.build_rows(500, seed=3)
    assert rows == demo_task.build_rows(500, seed=3)
    for row in rows:
        a, b = _operands(row["prompt"][0]["content"])
        assert max(a, b) == int(row["reward_model"]["ground_truth"])
    answers = [row["reward_model"]["ground_truth"] for row in rows]
    assert (
        set(answers) == {str(d) for d in range(10)} and max(map(answers.count, set(answers))) < 80
    )  # ~uniform


def _operands(question: str) -> tuple[int, int]:
    assert question.startswith("max(") and question.endswith(")=")
    a, b = question[4:-2].split(",")
    return int(a), int(b)


def test_warm_start_examples_have_random_answers():
    examples = demo_task.warm_start_examples(400, seed=0)
    right = sum(int(resp) == max(_operands(msgs[0]["content"])) for msgs, resp in examples)
    assert 10 < right < 80  # about one in ten: the format, not the answers
    with pytest.raises(ValueError):
        demo_task.make_problem(random.Random(0), max_digit=10)


def test_iteration_line_tolerates_missing_metrics():
    line = headline_line(3, {"critic/score/mean": 0.5, "timing_s/iteration": 2.0})
    assert (
        line.startswith("iteration    3 | score 0.500 | reward -")
        and "kl -" in line
        and line.endswith("2.0 s")
    )


# ------------------------------------------------------------------------------ the demo run

pytestmark_slow = pytest.mark.slow


@pytestmark_slow
def test_demo_run_succeeds_and_prints_progress(demo):
    assert demo["run"]["ok"], demo["run"]["error"]
    lines = demo["lines"]
    progress = [line for line in lines if line.startswith("iteration ")]
    assert progress[0].startswith("iteration    0 | val ") and progress[0].endswith("(before training)")
    assert (
        progress[1:3] == [line for line in lines if line.startswith(("iteration    1 |", "iteration    2 |"))]
        and "| val " in progress[2]
    )  # the held-out score at the end of the run
    text = "\n".join(lines)
    for needle in (
        "score:             iteration 1:",
        "difference",
        "wall time:",
        "plot:",
        "Prefect UI:",
        "ppoflow run " + os.path.join(demo["root"], "config.yaml"),
        "prefect deployment run ppo/iteration -p config=" + os.path.join(demo["root"], "config.yaml"),
    ):
        assert needle in text, f"{needle!r} missing from the demo output:\n{text}"


@pytestmark_slow
def test_demo_files_models_and_data(demo):
    root = demo["root"]
    for sub in ("models/base", "models/sft"):
        assert os.path.exists(os.path.join(root, sub, "config.json"))
        assert os.path.exists(os.path.join(root, sub, "tokenizer_config.json"))
    assert storage.read_json(os.path.join(root, "models/sft/sft.json"))["config"]["steps"] == 4
    table = pq.read_table(os.path.join(root, "data/train.parquet"))
    assert table.num_rows == 64
    assert {"prompt", "data_source", "ability", "reward_model", "extra_info"} <= set(table.column_names)
    row = table.slice(0, 1).to_pylist()[0]
    assert row["prompt"][0]["role"] == "user" and row["reward_model"]["style"] == "rule"
    assert row["data_source"] == demo_task.DATA_SOURCE and row["extra_info"]["split"] == "train"


@pytestmark_slow
def test_demo_experiment_artifacts(demo):
    url = demo["url"]
    manifest = storage.read_json(os.path.join(url, "manifest.json"))
    assert manifest["iteration"] == 2 and [r["iteration"] for r in manifest["trend"]] == [0, 1, 2]
    assert set(manifest["trend"][0]) == {"iteration", "val/score"}  # the baseline, before training
    from ppoflow.infra.checkpoint.marker import is_complete

    # snapshot_every 10: iteration 1 is rebuilt by replay when needed; 2, the last of the run, is written
    ckpt = os.path.join(url, "checkpoints", "actor")
    assert is_complete(os.path.join(ckpt, "000002")) and not is_complete(os.path.join(ckpt, "000001"))
    for n in (1, 2):
        it = os.path.join(url, "iterations", f"{n:06d}")
        for name in ARROW_FILES:
            with open(os.path.join(it, f"{name}.arrow"), "rb") as f:
                table = pyarrow.ipc.open_file(f).read_all()  # plain pyarrow, no ppoflow code
            assert table.num_rows == (8 if name == "prompts" else 16), name
        metrics = storage.read_json(os.path.join(it, "metrics.json"))
        missing = [k for k in METRIC_KEYS if k not in metrics]
        assert not missing, f"metrics.json of iteration {n} lacks {missing}"
        assert 0.0 <= metrics["critic/score/mean"] <= 1.0
    with open(os.path.join(url, "plots", "metrics.png"), "rb") as f:
        png = f.read()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    from PIL import Image

    assert Image.open(io.BytesIO(png)).size[0] > 100


@pytestmark_slow
def test_prepare_again_reuses_everything(demo):
    cfg = prepare(demo["root"], SMALL, log=None)
    assert cfg.storage.experiment_url == demo["url"] and cfg.model.path == os.path.join(
        demo["root"], "models", "sft"
    )
    for name, mtime in demo["mtimes"].items():
        assert os.path.getmtime(os.path.join(demo["root"], name)) == mtime, f"{name} was rebuilt"


# ------------------------------------------------------------------------------ plots, TensorBoard, SFT


def _history(n: int = 5) -> list[dict]:
    return [
        {
            "iteration": i,
            "critic/score/mean": 0.1 * i,
            "critic/rewards/mean": 0.1 * i - 0.01,
            "actor/reward_kl_penalty": 0.01 * i,
            "response_length/mean": 2.0,
            "critic/vf_loss": 1.0 / i,
            "timestamp": 1.7e9 + 5 * i,
            "note": "text is skipped",
        }
        for i in range(1, n + 1)
    ]


def test_plot_metrics_writes_a_png_to_any_url(tmp_path):
    from ppoflow.infra.experiment.plots import plot_metrics, series

    url = plot_metrics(_history(), str(tmp_path / "sub" / "m.png"), title="t")
    data = open(url, "rb").read()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert not [p for p in os.listdir(tmp_path / "sub") if p != "m.png"]  # no temp file left
    assert plot_metrics([], "memory://plots/empty.png") == "memory://plots/empty.png"  # "no data" panels
    assert storage.read_bytes("memory://plots/empty.png").startswith(PNG_MAGIC)
    assert series([{"a": 1.0}, {"b": 2}, {"a": float("nan")}, {"a": 3, "iteration": 9}], "a") == (
        [1.0, 9.0],
        [1.0, 3.0],
    )
    with pytest.raises(TypeError):
        plot_metrics({"critic/score/mean": 1.0}, str(tmp_path / "x.png"))


def test_tensorboard_events_are_readable_and_append_only(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ppoflow.infra.experiment.tensorboard import event_bytes, write_events

    history = _history(6)
    assert event_bytes(history).startswith(event_bytes(history[:3]))  # a longer history appends
    url = write_events(history, str(tmp_path / "tb"))
    assert os.path.basename(url).startswith("events.out.tfevents.")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "critic/score/mean" in acc.Tags()["scalars"] and "note" not in acc.Tags()["scalars"]
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("critic/vf_loss")][:2] == [(1, 1.0), (2, 0.5)]


def test_sft_teaches_the_format_and_publishes_a_hf_directory(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppoflow.demo.sft import SUMMARY_FILE, sft
    from ppoflow.demo.tiny_models import save_tiny_model

    base = save_tiny_model(str(tmp_path / "base"), hidden_size=64, num_layers=1, num_heads=2)
    examples = [([{"role": "user", "content": f"{i}+0="}], str(i)) for i in range(10)]
    summary = sft(
        base, str(tmp_path / "sft"), examples, SFTConfig(steps=40, batch_size=10, lr=3e-3), log=None
    )
    assert summary["loss_last"] < summary["loss_first"] / 2
    assert storage.read_json(str(tmp_path / "sft" / SUMMARY_FILE))["examples"] == 10
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "sft"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sft"))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "3+0="}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out[0, -1].item() == tok.eos_token_id or tok.eos_token_id in out[0].tolist()
    with pytest.raises(FileExistsError):
        sft(base, str(tmp_path / "sft"), examples, SFTConfig(steps=1), log=None)
    assert torch.is_tensor(out)
