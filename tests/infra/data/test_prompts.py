"""Prompt data: veRL-format parquet, a resumable deterministic order, left-padded tokens."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppoflow.demo.tiny_models import build_char_tokenizer
from ppoflow.infra.data.prompts import DataError, PromptDataset


def write_prompts(path, n: int, start: int = 0, long_every: int = 0) -> str:
    """``n`` veRL-format rows: "what is a+b?" with its answer as the ground truth."""
    rows = []
    for i in range(start, start + n):
        q = f"what is {i}+{i % 7}?" + (" pad" * 40 if long_every and i % long_every == 0 else "")
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": q}],
                "ability": "math",
                "reward_model": {"ground_truth": str(i + i % 7), "style": "rule"},
                "extra_info": {"index": i, "split": "train"},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_order_is_deterministic_and_the_cursor_resumes_exactly(tmp_path):
    ds = PromptDataset(
        [write_prompts(tmp_path / "a.parquet", 7), write_prompts(tmp_path / "b.parquet", 3, 7)]
    )
    assert len(ds) == 10
    cursor, seen = {"epoch": 0, "offset": 0}, []
    cursors = [cursor]
    for _ in range(5):  # 5 batches of 4 = 2 epochs exactly
        rows, cursor = ds.take(cursor, 4, seed=3, shuffle=True)
        seen.append(rows)
        cursors.append(cursor)
    assert cursors[-1] == {"epoch": 2, "offset": 0}
    flat = [r for batch in seen for r in batch]
    assert sorted(r.index for r in flat if r.epoch == 0) == list(range(10))  # each epoch: a permutation
    assert [r.index for r in flat if r.epoch == 0] != [r.index for r in flat if r.epoch == 1]
    assert seen[2][:2] == [r for r in flat[8:10]] and seen[2][2].epoch == 1  # wraps into epoch 1
    # resuming from any stored cursor gives the same batches as never stopping
    for k in range(5):
        again, _ = ds.take(cursors[k], 4, seed=3, shuffle=True)
        assert again == seen[k]
    # a fresh dataset object (another run) agrees; another seed does not
    ds2 = PromptDataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])
    assert ds2.take({"epoch": 0, "offset": 0}, 4, seed=3, shuffle=True)[0] == seen[0]
    assert ds2.take({"epoch": 0, "offset": 0}, 10, seed=4, shuffle=True)[0] != flat[:10]
    assert [r.index for r in ds.take({"epoch": 0, "offset": 0}, 10, seed=3, shuffle=False)[0]] == list(
        range(10)
    )
    assert len({r.uid for r in flat}) == 20  # one uid per prompt row (and epoch)


def test_tokenize_left_pads_and_truncates_on_the_left(tmp_path, caplog):
    tok = build_char_tokenizer()
    ds = PromptDataset([write_prompts(tmp_path / "a.parquet", 6, long_every=3)])
    rows, _ = ds.take({"epoch": 0, "offset": 0}, 6, seed=0, shuffle=False)
    with caplog.at_level("WARNING"):
        proto, stats = ds.tokenize(
            rows, tok, prompt_length=48, apply_chat_template=True, meta_info={"iteration": 1}
        )
    assert stats["truncated"] == 2 and "lost their first tokens" in caplog.text
    ids, mask, pos = (proto.batch[k] for k in ("input_ids", "attention_mask", "position_ids"))
    assert ids.shape == mask.shape == pos.shape == (6, 48)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "what is 1+1?"}], add_generation_prompt=True, tokenize=False
    )
    want = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[1, -len(want) :].tolist() == want and mask[1].sum() == len(want)
    assert (ids[1, : -len(want)] == tok.pad_token_id).all() and (mask[1, : -len(want)] == 0).all()
    assert pos[1, -len(want) :].tolist() == list(range(len(want)))
    # the long prompt keeps its end (the generation prompt)
    assert mask[0].all() and tok.decode(ids[0].tolist()).endswith("pad<|assistant|>")
    nt = proto.non_tensor_batch
    assert list(nt["ground_truth"][:2]) == ["0", "2"] and nt["data_source"][0] == "openai/gsm8k"
    assert nt["extra_info"][1] == {"index": 1, "split": "train"}
    assert nt["raw_prompt"][1] == [{"role": "user", "content": "what is 1+1?"}]
    assert list(nt["uid"][:2]) == ["0-0", "0-1"]
    # stores and reloads through the Arrow codec, readable by plain pyarrow
    proto.save(str(tmp_path / "p.arrow"))
    table = pa.ipc.open_file(str(tmp_path / "p.arrow")).read_all()
    assert table.num_rows == 6 and "uid" in table.column_names


def test_without_chat_template_and_with_string_prompts(tmp_path):
    tok = build_char_tokenizer()
    pq.write_table(
        pa.Table.from_pylist(
            [{"data_source": "x", "prompt": "hello", "reward_model": {"ground_truth": "1"}}]
        ),
        tmp_path / "s.parquet",
    )
    ds = PromptDataset([str(tmp_path / "s.parquet")])
    proto, _ = ds.tokenize(
        ds.take({}, 1, seed=0, shuffle=False)[0], tok, prompt_length=8, apply_chat_template=False
    )
    assert tok.decode(proto.batch["input_ids"][0][proto.batch["attention_mask"][0].bool()]) == "hello"


def test_clear_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        PromptDataset([str(tmp_path / "missing.parquet")])
    pq.write_table(pa.Table.from_pylist([{"question": "hi", "data_source": "x"}]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"missing column\(s\) \['prompt', 'reward_model'\].*data.prompt_key"):
        PromptDataset([str(tmp_path / "bad.parquet")])
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable parquet"):
        PromptDataset([str(tmp_path / "junk.parquet")])
    with pytest.raises(DataError, match="empty"):
        PromptDataset([])
    # ground truth is optional when no rule reward needs it
    assert (
        len(PromptDataset([str(tmp_path / "bad.parquet")], prompt_key="question", require_ground_truth=False))
        == 1
    )
    tok = build_char_tokenizer()
    tok.chat_template = None
    ds = PromptDataset([write_prompts(tmp_path / "a.parquet", 2)])
    with pytest.raises(DataError, match="no chat template"):
        ds.tokenize(ds.take({}, 1, seed=0, shuffle=False)[0], tok, prompt_length=8, apply_chat_template=True)
