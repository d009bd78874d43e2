"""The errors of the remote-call layer, as both ends see them.

A rank that raises reports its exception's type as the qualified names of its class and bases
(:func:`error_types`), so the driver can classify an error it cannot import (a ``DataError``
raised in a rank is as permanent as one raised in the flow process).
"""

from __future__ import annotations

__all__ = ["RankFailure", "GroupCannotStart", "WorkerGroupDead", "qualified_name", "error_types"]


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the group was killed. The message holds the rank number,
    the method and the traceback (or the launcher's output tail).

    ``error_types``: when a rank raised, the qualified names (``module.Class``) of its exception's
    class and every base class, so the driver can tell a deterministic error (a ``DataError`` in a
    rank) from one a retry may fix; empty when a rank died or timed out.
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        method: str | None = None,
        error_types: tuple[str, ...] = (),
    ):
        super().__init__(message)
        self.rank = rank
        self.method = method
        self.error_types = tuple(error_types)

    def raised(self, *classes: type[BaseException]) -> bool:
        """True when the rank's exception was an instance of one of ``classes`` (by qualified name)."""
        names = {qualified_name(c) for c in classes}
        return any(name in names for name in self.error_types)


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class: how exception types travel from the ranks (as JSON)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def error_types(exc: BaseException) -> list[str]:
    """The qualified names of ``exc``'s class and its bases (what a rank reports with an error)."""
    return [qualified_name(c) for c in type(exc).__mro__]


class GroupCannotStart(RankFailure):
    """A worker group whose start failed in a way a retry cannot change: its ranks exited with an
    error before they all connected (an import, a bad environment variable, a device the rank
    cannot open), or a rank's worker class or a module it needs did not import. The message holds
    the cause and the last lines of the ranks' output; the group was killed.

    Its own qualified name is among ``error_types`` (after the rank exception's, if one raised), so
    code that classifies a :class:`RankFailure` by the names it carries (the tasks' retry rule)
    sees this class as it sees a rank's exception."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        method: str | None = None,
        error_types: tuple[str, ...] = (),
    ):
        names = tuple(error_types)
        own = qualified_name(GroupCannotStart)
        super().__init__(message, rank, method, names if own in names else (*names, own))


class WorkerGroupDead(RuntimeError):
    """A call on a group that failed before or was shut down: start a new WorkerGroup."""
