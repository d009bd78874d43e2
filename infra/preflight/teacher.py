"""The preflight's check of a teacher (on-policy distillation, docs/distillation.md): it must
share the student's tokenizer.

The teacher scores the student's sampled token ids with its own embedding table: under another
tokenizer the same id is another piece of text, and its "log-prob" would be of a token nobody
sampled. Nothing would fail; the student would be trained toward noise. So the two tokenizers are
compared before anything starts (loading one costs well under a second): the vocabulary (every
token and its id, added tokens too) and the special tokens (which tokens, and the ids of eos,
pad, bos and unk).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.preflight.report import Checks

__all__ = ["check_teacher", "tokenizer_differences"]

_ROLES = ("eos", "pad", "bos", "unk")


def tokenizer_differences(student: Any, teacher: Any, shown: int = 3) -> list[str]:
    """How two Hugging Face tokenizers differ where the teacher's log-probs would be read wrong:
    their vocabularies (token -> id) and special tokens; empty when they agree."""
    out: list[str] = []
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        moved = sorted(t for t in a.keys() & b.keys() if a[t] != b[t])
        only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
        parts = [f"{len(a)} tokens vs {len(b)}"]
        if moved:
            parts.append(f"{len(moved)} with other ids (e.g. {', '.join(repr(t) for t in moved[:shown])})")
        if only_a:
            parts.append(f"{len(only_a)} only the student's (e.g. {', '.join(map(repr, only_a[:shown]))})")
        if only_b:
            parts.append(f"{len(only_b)} only the teacher's (e.g. {', '.join(map(repr, only_b[:shown]))})")
        out.append("vocabularies differ: " + "; ".join(parts))
    specials_a, specials_b = _special_tokens(student), _special_tokens(teacher)
    if specials_a != specials_b:
        out.append(f"special tokens differ: {specials_a} vs {specials_b}")
    for role in _ROLES:
        ida, idb = getattr(student, f"{role}_token_id", None), getattr(teacher, f"{role}_token_id", None)
        if ida != idb:
            out.append(f"{role} token id {ida} vs {idb}")
    return out


def _special_tokens(tokenizer: Any) -> list[str]:
    """The named special tokens and the added tokens marked special, sorted."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    return sorted(set(tokenizer.all_special_tokens) | {t.content for t in added if t.special})


def check_teacher(
    cfg: ExperimentConfig, student: Any, c: Checks, load: Callable[[str, bool], Any] | None = None
) -> None:
    """With a teacher: its tokenizer loads and equals ``student`` (the policy's tokenizer, None
    when it did not load: its own problem is reported). ``load(path, trust_remote_code)`` loads a
    tokenizer (default: ``AutoTokenizer.from_pretrained``)."""
    teacher = cfg.teacher
    if teacher is None or student is None:
        return
    where = f"teacher.model.path={teacher.model.path}"
    if teacher.model.tokenizer != teacher.model.path:
        where = f"teacher.model.tokenizer_path={teacher.model.tokenizer}"
    try:
        theirs = (load or _auto_tokenizer)(teacher.model.tokenizer, teacher.model.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
        c.problem(
            where,
            f"the teacher's tokenizer does not load ({type(exc).__name__}: {exc})",
            "point teacher.model.path (or teacher.model.tokenizer_path) at a directory with the "
            "tokenizer's files",
        )
        return
    differences = tokenizer_differences(student, theirs)
    if differences:
        c.problem(
            where,
            f"the teacher's tokenizer ({teacher.model.tokenizer}) is not the student's "
            f"({cfg.model.tokenizer}): " + "; ".join(differences),
            "distill from a teacher with the same tokenizer (the teacher scores the student's token "
            "ids: under another vocabulary they are other text)",
        )
        return
    c.ok(f"teacher: {teacher.model.tokenizer} shares the student's tokenizer")


def _auto_tokenizer(path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
