"""The wire protocol of the remote-call layer: every message between the driver, the node agents
and the ranks, as typed models. JSON on the wire, validated on both ends, never pickle.

A message is a pydantic model with a literal ``type``; :func:`send` writes one as UTF-8 JSON bytes
(``Connection.send_bytes``), :func:`receive` reads one and returns the model its ``type`` names,
optionally only one of ``expect`` (anything else, or a field of the wrong kind, raises
:class:`ProtocolError` naming the message). Unknown fields are refused, so the two ends of a link
cannot drift apart silently.

Driver and rank, one authenticated link per rank (:mod:`ppoflow.infra.remote.rank.entry`)::

    rank   -> driver  Hello     rank, world_size, local_rank, pid, group, node, host
    driver -> rank    Init      config (the worker's JSON config)
    rank   -> driver  Ready     ok; methods {name: dispatch mode} and layout | failure
    driver -> rank    Call      id, method, args, kwargs; in_url, out_url (DP_COMPUTE_PROTO)
    rank   -> driver  Reply     id, ok; kind + result, metric_rules and layout | failure
    driver -> rank    Shutdown  id   (the rank replies, then exits)

Node agent and driver, one link per node (:mod:`ppoflow.infra.remote.agent.node_agent`)::

    agent  -> driver  AgentHello  protocol, node, nnodes, host, pid       (type "agent")
    driver -> agent   Welcome     driver, protocol  |  Refused  reason, retry
    driver -> agent   Start       group, worker, device, nnodes, nproc_per_node, rdzv_endpoint,
                                  driver_addr, join_timeout_s, env
    driver -> agent   Kill        group
    agent  -> driver  Started     group, pid  |  Output  group, line  |  Exited  group, status
                      AgentError  group, error                               (type "error")

A rank of a multi-node group dials the driver's control endpoint too; its first message there is
its :class:`Hello`, which the endpoint tells from an agent's :class:`AgentHello` by ``type``.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Annotated, Any, Literal, TypeVar, overload

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError

from ppoflow.infra.remote.metric_merge import MetricRule

__all__ = [
    "PROTOCOL",
    "ProtocolError",
    "Message",
    "Layout",
    "Failure",
    "Hello",
    "Init",
    "Ready",
    "Call",
    "Reply",
    "Shutdown",
    "AgentHello",
    "Welcome",
    "Refused",
    "Start",
    "Kill",
    "Started",
    "Output",
    "Exited",
    "AgentError",
    "encode",
    "decode",
    "send",
    "receive",
]

#: The version of the agent <-> driver protocol; an agent of another version is refused.
PROTOCOL = 2


class ProtocolError(ValueError):
    """A message that is not JSON, names an unknown ``type``, is not one the reader expects, or
    has a missing or ill-typed field."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Layout(_Message):
    """How a rank's worker takes part in DP_COMPUTE_PROTO calls (re-read after every call)."""

    dp_rank: int
    dp_size: int
    is_output_rank: bool = True


class Failure(_Message):
    """What a rank reports when a method (or the worker's constructor) raised.

    ``error_types`` are the qualified names of the exception's class and its bases, so the driver
    can tell a deterministic error (a ``DataError`` in a rank) from one a retry may fix."""

    error: str
    error_types: list[str] = Field(default_factory=list)
    traceback: str = ""


# ---------------------------------------------------------------------- driver <-> rank
class Hello(_Message):
    type: Literal["hello"] = "hello"
    rank: int
    world_size: int
    local_rank: int
    pid: int
    group: str = ""
    node: int = 0
    host: str = ""


class Init(_Message):
    type: Literal["init"] = "init"
    config: dict[str, JsonValue] = Field(default_factory=dict)


class Ready(_Message):
    """The worker was built (``methods``, ``layout``), or its construction failed (``failure``)."""

    type: Literal["ready"] = "ready"
    ok: bool
    methods: dict[str, str] = Field(default_factory=dict)
    layout: Layout | None = None
    failure: Failure | None = None


class Call(_Message):
    type: Literal["call"] = "call"
    id: int
    method: str
    args: list[JsonValue] = Field(default_factory=list)
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    in_url: str | None = None
    out_url: str | None = None


class Reply(_Message):
    """The outcome of a :class:`Call` (or of :class:`Shutdown`).

    ``kind``: ``json`` (``result`` is the method's JSON result), ``dataproto`` (``result`` is the
    URL the rank saved its DataProto at), ``dropped`` (a DataProto of a rank that is not an output
    rank: nothing saved). ``metric_rules``, with a DataProto: how its ``meta_info["metrics"]``
    merge over the dp shards, as the method declared them with ``@register``
    (:mod:`ppoflow.infra.remote.metric_merge`)."""

    type: Literal["reply"] = "reply"
    id: int
    ok: bool
    kind: Literal["json", "dataproto", "dropped"] = "json"
    result: JsonValue = None
    metric_rules: tuple[MetricRule, ...] = ()
    layout: Layout | None = None
    failure: Failure | None = None


class Shutdown(_Message):
    type: Literal["shutdown"] = "shutdown"
    id: int


# ---------------------------------------------------------------------- agent <-> driver
class AgentHello(_Message):
    type: Literal["agent"] = "agent"
    protocol: int
    node: int
    nnodes: int | None = None
    host: str = ""
    pid: int = 0


class Welcome(_Message):
    type: Literal["welcome"] = "welcome"
    driver: str
    protocol: int = PROTOCOL


class Refused(_Message):
    type: Literal["refused"] = "refused"
    reason: str
    retry: bool = False


class Start(_Message):
    type: Literal["start"] = "start"
    group: str
    worker: str
    device: str
    nnodes: int
    nproc_per_node: int
    rdzv_endpoint: str
    driver_addr: str
    join_timeout_s: float = 300.0
    env: dict[str, str] = Field(default_factory=dict)


class Kill(_Message):
    type: Literal["kill"] = "kill"
    group: str


class Started(_Message):
    type: Literal["started"] = "started"
    group: str
    pid: int


class Output(_Message):
    type: Literal["output"] = "output"
    group: str
    line: str


class Exited(_Message):
    type: Literal["exited"] = "exited"
    group: str
    status: int


class AgentError(_Message):
    type: Literal["error"] = "error"
    group: str
    error: str


Message = Annotated[
    Hello
    | Init
    | Ready
    | Call
    | Reply
    | Shutdown
    | AgentHello
    | Welcome
    | Refused
    | Start
    | Kill
    | Started
    | Output
    | Exited
    | AgentError,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(Message)

M = TypeVar("M", bound=_Message)
M2 = TypeVar("M2", bound=_Message)
M3 = TypeVar("M3", bound=_Message)
M4 = TypeVar("M4", bound=_Message)


def encode(msg: _Message) -> bytes:
    """One message as UTF-8 JSON bytes."""
    return msg.model_dump_json().encode()


def decode(data: bytes, *expect: type[M]) -> M:
    """The message ``data`` holds; with ``expect``, it must be one of those classes."""
    try:
        msg = _ADAPTER.validate_json(data)
    except ValidationError as err:
        head = data[:200].decode("utf-8", "replace")
        raise ProtocolError(
            f"not a valid ppoflow message ({err.error_count()} errors: {err}): {head}"
        ) from None
    if expect and not isinstance(msg, expect):
        names = " or ".join(cls.__name__ for cls in expect)
        raise ProtocolError(f"expected {names}, got a {type(msg).__name__} message: {msg!r}")
    return msg


def send(conn: Connection, msg: _Message) -> None:
    """Send one message on a link (``OSError`` when the peer is gone)."""
    conn.send_bytes(encode(msg))


# One overload per number of expected classes, so that the result is their union.
@overload
def receive(conn: Connection, e1: type[M], /) -> M: ...
@overload
def receive(conn: Connection, e1: type[M], e2: type[M2], /) -> M | M2: ...
@overload
def receive(conn: Connection, e1: type[M], e2: type[M2], e3: type[M3], /) -> M | M2 | M3: ...
@overload
def receive(
    conn: Connection, e1: type[M], e2: type[M2], e3: type[M3], e4: type[M4], /
) -> M | M2 | M3 | M4: ...
@overload
def receive(conn: Connection, *expect: type[M]) -> M: ...
def receive(conn: Connection, *expect: type[_Message]) -> _Message:
    """Receive one message (``EOFError``/``OSError`` when the peer is gone; :class:`ProtocolError`
    for a message that is not one of ``expect``)."""
    return decode(conn.recv_bytes(), *expect)
