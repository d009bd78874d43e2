"""The ``ppo-retrain`` flow's decision as its artifact shows it. The whole loop (train, evaluate,
promote or keep, the event and the artifact as a real server holds them, the promoted directory
loading as the trained iteration) runs in tests/flows/test_deployment.py, through the retraining
deployment."""

from __future__ import annotations

from ppoflow.flows.retrain import decision_markdown
from ppoflow.infra.experiment.promotion import decide


def _rows(markdown: str) -> dict[str, str]:
    """The table's rows of the markdown, ``{first cell: second cell}`` (not its empty header)."""
    cells = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith("| ")]
    return {a.strip(): b.strip() for a, b in cells if a.strip()}


def test_the_decision_markdown_shows_the_verdict_and_its_numbers():
    promoted = decide("gain", "val/score", {"val/score": 0.75}, {"metric": "val/score", "value": 0.5})
    text = decision_markdown("exp", 12, "val/score", promoted, "/runs/exp/promoted")
    assert text.startswith("# exp: iteration 12 promoted\n")
    assert _rows(text) == {
        "decision": "**promoted**",
        "metric": "`val/score`",
        "iteration 12": "0.7500",
        "promoted before": "0.5000",
        "gain": "0.2500",
        "why": "val/score gained +0.2500 (min_gain 0)",
        "promoted policy": "`/runs/exp/promoted`",
    }
    kept = decide("gain", "val/score", {"loss": 1.0}, None)  # no such metric: nothing to compare
    text = decision_markdown("exp", 3, "val/score", kept, "/runs/exp/promoted")
    assert text.startswith("# exp: iteration 3 kept the promoted policy\n")
    rows = _rows(text)
    assert (rows["decision"], rows["iteration 3"], rows["promoted before"], rows["gain"]) == (
        "**kept**",
        "-",
        "-",
        "-",
    )
    assert rows["why"].startswith("the evaluation has no val/score")
