"""ppoflow.infra.checkpoint.gguf_import: the tokenizer config an import writes (the import of a
real GGUF model end to end is in tests/scenarios/test_real_model.py)."""

from __future__ import annotations

import json
import os

from ppoflow.demo.tiny_models import build_char_tokenizer
from ppoflow.infra.checkpoint.gguf_import import disable_ignored_cleanup

TEXT = "Hello , world ! It 's 12 + 30 = 42 ."


def _saved(tmp_path, **config) -> str:
    """A byte-level BPE tokenizer saved in a directory whose tokenizer_config.json has ``config``
    added (as transformers 5.17's GGUF reader writes ``clean_up_tokenization_spaces: true``)."""
    out = str(tmp_path / "model")
    build_char_tokenizer().save_pretrained(out)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        saved = json.load(f)
    with open(path, "w") as f:
        json.dump({**saved, **config}, f)
    return out


def test_an_ignored_cleanup_is_written_false_and_decodes_the_same(tmp_path):
    from transformers import AutoTokenizer

    out = _saved(tmp_path, clean_up_tokenization_spaces=True)
    before = AutoTokenizer.from_pretrained(out)
    assert before.clean_up_tokenization_spaces is True  # what warns at every decode
    ids = before(TEXT)["input_ids"]
    assert disable_ignored_cleanup(out)
    after = AutoTokenizer.from_pretrained(out)
    assert after.clean_up_tokenization_spaces is False
    assert after.decode(ids) == before.decode(ids) == TEXT  # BPE ignored it: the same text
    assert not disable_ignored_cleanup(out)  # idempotent
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


def test_a_cleanup_that_applies_or_is_forced_is_kept(tmp_path):
    forced = _saved(
        tmp_path / "a",
        clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    )
    assert not disable_ignored_cleanup(forced)
    wordpiece = _saved(tmp_path / "b", clean_up_tokenization_spaces=True)
    with open(os.path.join(wordpiece, "tokenizer.json")) as f:
        tok = json.load(f)
    tok["model"]["type"] = "WordPiece"  # where the clean-up does something
    with open(os.path.join(wordpiece, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    assert not disable_ignored_cleanup(wordpiece)
    with open(os.path.join(wordpiece, "tokenizer_config.json")) as f:
        assert json.load(f)["clean_up_tokenization_spaces"] is True
