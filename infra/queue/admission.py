"""Which batches a producer may start now: :class:`Admission`, one class a user can swap.

The producer (``ppoflow.flows.asynchronous.rollout``) asks its admission, each time it looks at
the queue, which batches it may start given the committed iteration and the newest published
policy version; it then takes the lowest of them that no live producer holds. The default,
:class:`BoundedStaleness`, admits batch k once version ``k - 1 - max_staleness`` is published, so
the producer never runs further ahead than the bound (:func:`~ppoflow.infra.queue.staleness.admissible_batches`).

Another one is named in the config, ``asynchronous.admission: "my_pkg.admission:Eager"`` (a
module or ``.py`` file and a class); the class is built with the ``asynchronous`` section and
needs one method::

    class Eager:
        def __init__(self, settings): ...           # the AsyncConfig
        def admissible(self, committed, latest, until):
            return range(committed + 1, ...)        # batch numbers, lowest first

Whatever it admits, the trainer still refuses a batch that breaks ``max_staleness``
(:func:`~ppoflow.infra.queue.staleness.check_bound`): an admission decides when a producer
starts, not what the trainer accepts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from ppoflow.infra.plugins.loader import load_object
from ppoflow.infra.queue.staleness import admissible_batches

__all__ = ["Admission", "BoundedStaleness", "admission_of", "SETTING"]

#: The config key that names another admission class.
SETTING = "asynchronous.admission"


class Admission(Protocol):
    """Which batches a producer may start now (module docstring)."""

    def admissible(self, committed: int, latest: int | None, until: int | None) -> Iterable[int]:
        """The batch numbers, lowest first: ``committed`` is the last committed iteration,
        ``latest`` the newest published policy version (None before the first), ``until`` the
        last batch this producer samples (None: no end)."""
        ...


class BoundedStaleness:
    """The default: batch k once version ``k - 1 - max_staleness`` is published, up to ``until``."""

    def __init__(self, settings: Any):
        self.max_staleness = int(settings.max_staleness)

    def admissible(self, committed: int, latest: int | None, until: int | None) -> Iterable[int]:
        return admissible_batches(committed, latest, self.max_staleness, until)


def admission_of(settings: Any) -> Admission:
    """The admission the ``asynchronous`` section names (``admission``; None: :class:`BoundedStaleness`)."""
    spec = getattr(settings, "admission", None)
    if not spec:
        return BoundedStaleness(settings)
    cls = load_object(spec, SETTING, "Class")
    admission = cls(settings)
    if not callable(getattr(admission, "admissible", None)):
        raise TypeError(
            f"{SETTING}={spec!r}: {cls.__name__} has no admissible(committed, latest, until) method; "
            "define it (ppoflow.infra.queue.admission.Admission)"
        )
    return admission
