"""ppoflow.infra.remote.protocol: every message kind round-trips through its JSON bytes as the
same typed message, and a message that is not what the reader expects (unknown kind, unknown or
ill-typed field, the wrong kind for the moment, not JSON) is refused with a ProtocolError that
names it. Checked against the bytes themselves (plain json), not only the codec's own output."""

from __future__ import annotations

import json
from multiprocessing import Pipe

import pytest

from ppoflow.infra.remote import protocol as p

LAYOUT = p.Layout(dp_rank=1, dp_size=2, is_output_rank=False)
FAILURE = p.Failure(
    error="DataError: row 3", error_types=["ppoflow.infra.data.prompts.DataError"], traceback="tb"
)

EXAMPLES = [
    p.Hello(rank=1, world_size=2, local_rank=1, pid=123, group="g-actor-1", node=1, host="h1"),
    p.Init(config={"config": {"seed": 3}, "role": "critic"}),
    p.Ready(ok=True, methods={"init_model": "ONE_TO_ALL"}, layout=LAYOUT),
    p.Ready(ok=False, failure=FAILURE),
    p.Call(
        id=7,
        method="compute_values",
        args=[1, "x"],
        kwargs={"micro": 4},
        in_url="/s/in-0.arrow",
        out_url="/s/o",
    ),
    p.Reply(id=7, ok=True, kind="dataproto", result="/s/o", layout=LAYOUT),
    p.Reply(id=8, ok=True, kind="json", result={"loss": 0.5, "ok": [1, 2]}, layout=LAYOUT),
    p.Reply(id=9, ok=False, failure=FAILURE),
    p.Shutdown(id=10),
    p.AgentHello(protocol=p.PROTOCOL, node=1, nnodes=2, host="h1", pid=9),
    p.Welcome(driver="d:29401"),
    p.Refused(reason="node 1 is already served", retry=True),
    p.Start(
        group="g",
        worker="m:C",
        device="cuda",
        nnodes=2,
        nproc_per_node=8,
        rdzv_endpoint="d:29400",
        driver_addr="d:29401",
        join_timeout_s=60.0,
        env={"PPOFLOW_FAULT": ""},
    ),
    p.Kill(group="g"),
    p.Started(group="g", pid=5),
    p.Output(group="g", line="[rank0]: hi"),
    p.Exited(group="g", status=-9),
    p.AgentError(group="g", error="FileNotFoundError: torchrun"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: f"{type(m).__name__}")
def test_every_message_kind_round_trips_as_json(msg):
    data = p.encode(msg)
    plain = json.loads(data)  # JSON bytes, nothing else
    assert plain["type"] == msg.type and plain == msg.model_dump(mode="json")
    back = p.decode(data, type(msg))
    assert back == msg and type(back) is type(msg)


def test_a_message_travels_on_a_link_as_the_same_model():
    left, right = Pipe()
    p.send(left, EXAMPLES[4])
    assert p.receive(right, p.Call, p.Shutdown) == EXAMPLES[4]


def test_the_agent_and_rank_first_messages_are_told_apart_by_type():
    hello, agent = EXAMPLES[0], EXAMPLES[9]
    assert isinstance(p.decode(p.encode(hello), p.AgentHello, p.Hello), p.Hello)
    assert isinstance(p.decode(p.encode(agent), p.AgentHello, p.Hello), p.AgentHello)
    assert json.loads(p.encode(agent))["type"] == "agent"


@pytest.mark.parametrize(
    "data, needle",
    [
        (b'{"type": "hello", "rank": 1, "world_size": 2, "local_rank": 0, "pid": 1, "extra": 3}', "extra"),
        (b'{"type": "call", "id": "seven", "method": "m"}', "id"),
        (b'{"type": "reply", "id": 1, "ok": true, "kind": "pickle"}', "kind"),
        (b'{"type": "teleport"}', "teleport"),
        (b'{"rank": 1}', "type"),
        (b"not json at all", "not json"),
    ],
)
def test_a_message_that_is_not_valid_is_refused_and_named(data, needle):
    with pytest.raises(p.ProtocolError) as err:
        p.decode(data, p.Hello, p.Call, p.Reply)
    assert needle in str(err.value)


def test_the_wrong_kind_for_the_moment_is_refused():
    with pytest.raises(p.ProtocolError, match="expected Reply, got a Ready message"):
        p.decode(p.encode(EXAMPLES[2]), p.Reply)


def test_a_result_that_is_not_json_cannot_be_built():
    with pytest.raises(ValueError):
        p.Reply(id=1, ok=True, result={"tensor": object()})
