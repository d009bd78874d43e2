"""What Prefect recorded about a flow run the tests ran."""

from __future__ import annotations

from typing import Any


def attempts(state: Any) -> dict[str, int]:
    """How many times each task of the flow run behind ``state`` ran (1 = no retry)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    return {tr.name.rsplit("-", 1)[0]: tr.run_count for tr in runs}
