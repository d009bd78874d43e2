"""A rank's error as the driver classifies it: by the qualified names of its class and bases,
without importing the rank's code."""

from __future__ import annotations

from ppoflow.infra.data.prompts import DataError
from ppoflow.infra.remote.errors import RankFailure, error_types, qualified_name


class _Outer:
    class Nested(DataError):
        pass


def test_a_rank_failure_knows_the_classes_of_the_rank_s_exception():
    exc = _Outer.Nested("bad row")
    names = error_types(exc)
    assert names[0] == f"{__name__}._Outer.Nested" == qualified_name(_Outer.Nested)
    assert "ppoflow.infra.data.prompts.DataError" in names and names[-2:] == [
        "builtins.BaseException",
        "builtins.object",
    ]
    failure = RankFailure("rank 1 raised", rank=1, method="m", error_types=tuple(names))
    assert failure.raised(DataError) and failure.raised(KeyError, DataError)
    assert not failure.raised(KeyError)
    assert not RankFailure("rank 0 died", rank=0).raised(BaseException)  # no exception: nothing raised
