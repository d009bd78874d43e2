"""Preflight (``ppoflow.infra.preflight``) and the prompt-length policy, without ranks or Prefect.

Each broken experiment is built for real on disk (parquet files, model directories, a committed
checkpoint with its marker removed); the assertions are on what the user reads: every problem
named with its file or field, what was found and the fix, all in one error.
The tiny tokenizer has one token per byte, so a prompt's length is known independently:
``<|user|>`` + the content's bytes + ``<|assistant|>``.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppoflow.infra.data.prompts import DataError, PromptDataset, Row
from ppoflow.infra.preflight import PreflightError, preflight
from tests.support.configs import make_config, tokenizer_of


def prompt_tokens(content: str) -> int:
    """The reference length of a chat prompt with the tiny tokenizer (see the module docstring)."""
    return len(content.encode()) + 2


def rows(contents: list[str], source: str = "openai/gsm8k", truth: str | None = "3") -> list[dict]:
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": c}],
            "reward_model": {"ground_truth": truth, "style": "rule"},
            "extra_info": {"index": i},
        }
        for i, c in enumerate(contents)
    ]


def data_notes(report) -> list[str]:
    """The report's notes but the machine's (``resources:``, e.g. more ranks than cores here)."""
    return [n for n in report.notes if not n.startswith("resources:")]


def write(path, records: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(records), str(path))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from ppoflow.demo.tiny_models import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("pf") / "policy"))


def test_a_good_experiment_passes_and_the_cost_does_not_grow_with_the_data(tmp_path, model_dir):
    small = write(tmp_path / "small.parquet", rows(["1+2="] * 8))
    block = pa.Table.from_pylist(rows([f"{i}+1=" for i in range(1000)]))
    pq.write_table(pa.concat_tables([block] * 300), str(tmp_path / "big.parquet"))
    big = str(tmp_path / "big.parquet")
    timings = {}
    for name, path in (("small", small), ("big", big)):
        cfg = make_config(tmp_path, model_dir, [path])
        t0 = time.perf_counter()
        report = preflight(cfg, lambda: tokenizer_of(model_dir))
        timings[name] = time.perf_counter() - t0
        assert any("storage:" in line for line in report.passed)
        assert any(line.startswith("data:") and "first" in line for line in report.passed)
        assert any(line.startswith("reward: finite") for line in report.passed)
        assert "checkpoints: a new experiment (no manifest yet)" in report.passed
        assert not data_notes(report)
    print(f"\npreflight: {timings['small']:.2f} s on 8 rows, {timings['big']:.2f} s on 300k rows")
    assert timings["big"] < max(3.0, 3 * timings["small"]), timings  # a sample, not a pass
    assert not [n for n in os.listdir(tmp_path / "runs" / "exp")]  # the write probe left nothing


def test_every_problem_is_named_with_its_file_or_field_and_the_fix(tmp_path, model_dir):
    no_prompt = write(
        tmp_path / "no_prompt.parquet", [{k: v for k, v in r.items() if k != "prompt"} for r in rows(["a"])]
    )
    bad_rows = rows(["1+1="] * 3) + rows(["2+2="], source="my/unknown") + rows(["3+3="], truth=None)
    mixed = write(tmp_path / "mixed.parquet", bad_rows)
    missing = str(tmp_path / "missing.parquet")
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(os.path.join(model_dir, "config.json"), weightless / "config.json")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the storage root should be")
    cfg = make_config(
        tmp_path,
        model_dir,
        [no_prompt, mixed, missing],
        **{
            "critic.model": {"path": str(weightless)},
            "storage.root": str(blocker),
        },
    )
    t0 = time.perf_counter()
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(model_dir))
    took = time.perf_counter() - t0
    text = str(err.value)
    problems = [str(p) for p in err.value.problems]
    assert text.startswith(f"preflight found {len(problems)} problem(s); nothing was started")
    expect = {
        "storage": (f"storage.root={blocker}", "cannot write", "Fix: make the directory writable"),
        "critic": (f"critic.model.path={weightless}", "no weight files", "Fix: point it at a Hugging Face"),
        "column": (no_prompt, "missing column(s) ['prompt']", "Fix: write the rows in veRL's format"),
        "missing file": (f"data.train_files: {missing}", "does not exist", "Fix: check the path"),
        "unknown source": (
            f"{mixed} row 3",
            "no reward function for data_source 'my/unknown'",
            "register_reward",
        ),
        "ground truth": (f"{mixed} row 4", "reward_model.ground_truth is missing", "must hold the answer"),
    }
    for what, parts in expect.items():
        hits = [p for p in problems if all(part in p for part in parts)]
        assert len(hits) == 1, f"{what}: no single problem with {parts} in\n{text}"
    assert len(problems) == len(expect), text
    assert took < 10, took


def test_a_reward_function_that_returns_nan_and_one_that_does_not_import(tmp_path, model_dir):
    data = write(tmp_path / "d.parquet", rows(["1+2="] * 8))
    cfg = make_config(
        tmp_path, model_dir, [data], **{"reward.custom_function": "tests.support.rewards:always_nan"}
    )
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(model_dir))
    (problem,) = err.value.problems
    assert problem.where == "reward.custom_function='tests.support.rewards:always_nan'"
    assert "RewardError" in problem.found and "non-finite score (nan)" in problem.found
    assert "return a finite float" in problem.fix
    cfg = make_config(tmp_path, model_dir, [data], **{"reward.custom_function": "no_such_module:score"})
    with pytest.raises(PreflightError, match=r"reward.custom_function='no_such_module:score': ImportError"):
        preflight(cfg, lambda: tokenizer_of(model_dir))


def test_a_multi_turn_environment_or_tool_that_does_not_load(tmp_path, model_dir):
    data = write(tmp_path / "d.parquet", rows(["1+2="] * 8))
    over = {
        "rollout.multi_turn.enable": True,
        "rollout.multi_turn.environment": "no_such_module:Env",
        "rollout.multi_turn.tools": ["python", "calc"],
    }
    cfg = make_config(tmp_path, model_dir, [data], **over)
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(model_dir))
    env, tool = err.value.problems
    assert env.where == "rollout.multi_turn.environment='no_such_module:Env'" and "ImportError" in env.found
    assert tool.where == "rollout.multi_turn.tools: 'calc'" and "no tool 'calc'" in tool.found
    over = {**over, "rollout.multi_turn.environment": "tools", "rollout.multi_turn.tools": ["python"]}
    report = preflight(make_config(tmp_path, model_dir, [data], **over), lambda: tokenizer_of(model_dir))
    assert "multi-turn: environment 'tools', tools ['python']" in report.passed


def test_tracking_wandb_online_without_its_key_is_a_problem_and_offline_passes(
    tmp_path, model_dir, monkeypatch
):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    data = write(tmp_path / "d.parquet", rows(["1+2="] * 8))
    cfg = make_config(tmp_path, model_dir, [data], **{"tracking.wandb": {"project": "p"}})
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(model_dir))
    [problem] = err.value.problems
    assert problem.where == "tracking.wandb (mode: online)" and "WANDB_API_KEY is not set" in problem.found
    cfg = make_config(tmp_path, model_dir, [data], **{"tracking.wandb": {"project": "p", "mode": "offline"}})
    assert "tracking: W&B offline, project p" in preflight(cfg, lambda: tokenizer_of(model_dir)).passed


def test_a_reward_function_that_raises_fails_the_preflight(tmp_path, model_dir):
    data = write(tmp_path / "d.parquet", rows(["1+2="] * 8))
    fn = "tests.support.rewards:raises_key_error"
    cfg = make_config(tmp_path, model_dir, [data], **{"reward.custom_function": fn})
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(model_dir))
    (problem,) = err.value.problems
    assert problem.where == f"reward.custom_function={fn!r}"
    assert "KeyError" in problem.found and fn in problem.found and "row 0" in problem.found


def test_a_committed_checkpoint_without_its_marker_is_named_with_the_way_back(tmp_path, model_dir):
    from ppoflow.infra.checkpoint.sharded import MARKER
    from tests.support.experiments import commit_tiny_iterations

    data = write(tmp_path / "d.parquet", rows(["1+2="] * 8))
    cfg = make_config(
        tmp_path,
        model_dir,
        [data],
        **{"critic.enable": False, "algorithm.adv_estimator": "grpo", "rollout.n": 2},
    )
    paths = commit_tiny_iterations(cfg, last=1)
    assert "checkpoints: iteration 1's are complete" in preflight(cfg, lambda: tokenizer_of(model_dir)).passed
    # flipped bytes, size unchanged: the content hash differs from the marker's record
    shards = [
        os.path.join(folder, name)
        for folder, _, names in os.walk(paths.checkpoint("actor", 1))
        for name in names
        if name.endswith(".distcp")
    ]
    with open(shards[0], "r+b") as f:
        f.seek(os.path.getsize(shards[0]) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(model_dir))
    (problem,) = err.value.problems
    assert (
        os.path.basename(shards[0]) in problem.found
        and "content differs from the recorded hash" in problem.found
    )
    assert problem.fix.startswith(f"move the experiment back to iteration 0: ppoflow rollback {paths.root}")
    with open(shards[0], "r+b") as f:  # put it back
        f.seek(os.path.getsize(shards[0]) // 2)
        f.write(byte)
    assert "checkpoints: iteration 1's are complete" in preflight(cfg, lambda: tokenizer_of(model_dir)).passed
    # a truncated shard: its size no longer matches the marker's record
    shards = [
        os.path.join(folder, name)
        for folder, _, names in os.walk(paths.checkpoint("actor", 1))
        for name in names
        if name.endswith(".distcp")
    ]
    with open(shards[0], "r+b") as f:
        f.truncate(os.path.getsize(shards[0]) // 2)
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(model_dir))
    (problem,) = err.value.problems
    assert "damaged" in problem.found and os.path.basename(shards[0]) in problem.found
    os.remove(os.path.join(paths.checkpoint("actor", 1), MARKER))
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(model_dir))
    (problem,) = err.value.problems
    assert problem.where == f"{paths.manifest} (actor checkpoint of iteration 1)"
    assert "incomplete checkpoint" in problem.found and paths.checkpoint("actor", 1) in problem.found
    assert problem.fix.startswith(
        f"move the experiment back to iteration 0: ppoflow rollback {paths.root} --to 0"
    )


def test_prompt_lengths_follow_data_truncation(tmp_path, model_dir):
    contents = ["1+2=", "x" * 30, "123456789012=", "y" * 40]  # 6, 32, 15 and 42 tokens
    lengths = [prompt_tokens(c) for c in contents]
    over = [i for i, n in enumerate(lengths) if n > 16]
    data = write(tmp_path / "d.parquet", rows(contents))
    tok = tokenizer_of(model_dir)

    cfg = make_config(tmp_path, model_dir, [data], **{"data.truncation": "error"})
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tok)
    (problem,) = err.value.problems
    assert (
        problem.where == f"data.train_files: {data} row {over[0]} (and {len(over) - 1} more of the first 4)"
    )
    assert f"the prompt has {lengths[over[0]]} tokens, more than rollout.prompt_length=16" in problem.found
    assert f"raise rollout.prompt_length to at least {max(lengths)}" in problem.fix

    for policy, filtered in (("left", False), ("right", False), ("error", True)):
        cfg = make_config(
            tmp_path,
            model_dir,
            [data],
            **{"data.truncation": policy, "data.filter_overlong_prompts": filtered},
        )
        (note,) = data_notes(preflight(cfg, lambda: tok))
        assert f"{len(over)} of the first 4 prompts are longer than rollout.prompt_length=16" in note

    ds = PromptDataset([data])
    picked = [Row(0, i) for i in range(4)]
    for policy in ("left", "right"):
        proto, stats = ds.tokenize(picked, tok, prompt_length=16, apply_chat_template=True, truncation=policy)
        assert stats == {"truncated": len(over), "max_prompt_tokens": max(lengths)}
        for i, content in enumerate(contents):
            full = tok.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
            ids = tok(full, add_special_tokens=False)["input_ids"]
            want = ids[-16:] if policy == "left" else ids[:16]
            got = proto.batch["input_ids"][i][proto.batch["attention_mask"][i].bool()].tolist()
            assert got == want, (policy, i)
    with pytest.raises(
        DataError, match=rf"{data} row 1: the prompt has 32 tokens.*data.filter_overlong_prompts=true"
    ):
        ds.tokenize(picked, tok, prompt_length=16, apply_chat_template=True, truncation="error")

    assert ds.filter_overlong(tok, prompt_length=16, apply_chat_template=True) == len(over)
    kept = [contents[i] for i in range(4) if i not in over]
    assert [r[ds.prompt_key][0]["content"] for r in ds.records([Row(0, i) for i in range(len(ds))])] == kept
    assert ds.where(1) == f"{data} row 2"  # rows keep their place in the file in messages
    with pytest.raises(DataError, match="dropped every row"):
        PromptDataset([data]).filter_overlong(tok, prompt_length=3, apply_chat_template=True)


def test_the_config_names_the_truncation_values(tmp_path, model_dir):
    from ppoflow.infra.config import ConfigError

    with pytest.raises(ConfigError, match="data.truncation"):
        make_config(tmp_path, model_dir, ["x.parquet"], **{"data.truncation": "middle"})
    assert (
        json.loads(make_config(tmp_path, model_dir, ["x"]).model_dump_json())["data"]["truncation"] == "left"
    )


HUB_PROBE = """
import sys
from tests.support.configs import make_config, tokenizer_of
from ppoflow.infra.preflight import PreflightError, preflight
tmp, model, data = sys.argv[1:4]
import pathlib
cfg = make_config(pathlib.Path(tmp), model, [data])
try:
    preflight(cfg, lambda: tokenizer_of(cfg.model.tokenizer))
except PreflightError as err:
    print(err)
"""


def test_a_hub_id_where_the_hub_cannot_be_reached_is_named_at_once(tmp_path):
    """A hub id on a machine that cannot reach the hub (here: an endpoint on a closed local port):
    one problem per model saying so, with the fix, instead of huggingface_hub's minute of retries
    that ends in its own OSError; a model already in the cache gets the HF_HUB_OFFLINE fix."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a local port that nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tmp_path / "hf"
    snapshot = home / "hub" / "models--org--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (home / "hub" / "models--org--cached" / "refs").mkdir()
    (home / "hub" / "models--org--cached" / "refs" / "main").write_text("abc")
    data = write(tmp_path / "train.parquet", rows(["1+2"] * 4))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HTTP", "http", "ALL_PROXY"))}
    env.update(HF_HOME=str(home), HF_ENDPOINT=f"http://127.0.0.1:{port}", PYTHONPATH=os.getcwd())
    said = {}
    for model in ("org/missing", "org/cached"):
        out = subprocess.run(
            [sys.executable, "-c", HUB_PROBE, str(tmp_path / model.split("/")[1]), model, data],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        said[model] = out.stdout
        print(out.stdout)
    unreachable = f"http://127.0.0.1:{port} cannot be reached from this machine"
    missing = said["org/missing"]
    assert (
        f"model.path=org/missing: a hub id that is not in this machine's Hugging Face cache, and {unreachable}"
        in missing
    )
    assert "hf download ORG/NAME --local-dir DIR" in missing
    cached = said["org/cached"]
    assert f"model.path=org/cached: a hub id, and {unreachable} (" in cached
    assert "); it is in this machine's Hugging Face cache. Fix: set HF_HUB_OFFLINE=1" in cached
    for text in said.values():  # one problem for the model (the tokenizer is the same id), no retry noise
        assert "tokenizer" not in text and "Retrying" not in text and "couldn't connect" not in text


def test_held_out_files_are_read_as_training_files_are_naming_the_list_file_and_row(tmp_path, model_dir):
    train = write(tmp_path / "train.parquet", rows(["1+2="] * 8))
    no_truth = [{**r, "reward_model": {"style": "rule"}} for r in rows(["1+2="] * 3)]  # no ground_truth field
    val_schema = write(tmp_path / "val_schema.parquet", no_truth)
    val_rows = write(tmp_path / "val_rows.parquet", rows(["1+1="]) + rows(["2+2="] * 2, truth=None))
    contents = ["1+2=", "x" * 30]  # 6 and 32 tokens
    val_long = write(tmp_path / "val_long.parquet", rows(contents))
    missing = str(tmp_path / "val_missing.parquet")
    cfg = make_config(
        tmp_path,
        model_dir,
        [train],
        **{
            "data.val_files": [val_schema, val_rows, val_long, missing],
            "data.truncation": "error",
            "data.filter_overlong_prompts": True,  # drops training prompts, never held-out ones
        },
    )
    t0 = time.perf_counter()
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(model_dir))
    took = time.perf_counter() - t0
    problems = {p.where: p for p in err.value.problems}
    assert sorted(problems) == sorted(
        [
            f"data.val_files: {val_schema} column 'reward_model'",
            f"data.val_files: {val_rows} row 1 (and 1 more of the first 3)",
            f"data.val_files: {val_long} row 1",
            f"data.val_files: {missing}",
        ]
    ), str(err.value)
    assert "no 'ground_truth' field" in problems[f"data.val_files: {val_schema} column 'reward_model'"].found
    truth = problems[f"data.val_files: {val_rows} row 1 (and 1 more of the first 3)"]
    assert truth.found == "reward_model.ground_truth is missing"
    long = problems[f"data.val_files: {val_long} row 1"]
    assert long.found == (
        f"the prompt has {prompt_tokens(contents[1])} tokens, more than rollout.prompt_length=16 "
        "(data.truncation=error)"
    )
    assert "every held-out prompt is evaluated" in long.fix
    assert "does not exist" in problems[f"data.val_files: {missing}"].found
    print(f"\npreflight of 1 training and 4 held-out files: {took:.2f} s")
    assert took < 10

    # the same prompts as training data are dropped (a note), and good held-out files pass
    ok = make_config(
        tmp_path,
        model_dir,
        [val_long],
        **{
            "data.val_files": [train],
            "data.truncation": "error",
            "data.filter_overlong_prompts": True,
        },
    )
    report = preflight(ok, lambda: tokenizer_of(model_dir))
    assert f"data: data.val_files: {train} (8 rows; schema and the first 8 rows checked)" in report.passed
    assert any("they will be dropped" in n for n in data_notes(report))


def test_an_experiment_name_taken_by_other_files_at_the_root_is_refused(tmp_path, model_dir):
    data = write(tmp_path / "d.parquet", rows(["1+2="] * 8))
    cfg = make_config(tmp_path, model_dir, [data])
    exp = tmp_path / "runs" / "exp"
    exp.mkdir(parents=True)
    (exp / "notes.txt").write_text("the operator's own files")
    (exp / "lock.json").write_text("{}")  # the run's lock is taken before the preflight
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(model_dir))
    (problem,) = err.value.problems
    assert problem.where == "storage.experiment=exp"
    assert problem.found.startswith(f"{exp} holds files that are not an experiment's (notes.txt)")
    assert "name the experiment otherwise" in problem.fix
    assert sorted(os.listdir(exp)) == ["lock.json", "notes.txt"]  # nothing written there
    (exp / "manifest.json").write_text("{}")  # an experiment (with notes of its own) is one
    from ppoflow.infra.preflight.checks import _foreign

    assert _foreign(str(exp)) == []
