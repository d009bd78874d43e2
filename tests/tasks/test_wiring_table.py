import os

from ppoflow.tasks.graph import STEPS
from ppoflow.tasks.wiring_table import PLACEMENT, wiring_table
from tests.support.paths import ROOT


def test_the_table_has_every_row_with_its_group_reads_and_output():
    lines = wiring_table().splitlines()[2:]
    assert len(lines) == len(STEPS)
    for step, line in zip(STEPS, lines):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == str(step.stage) and cells[1] == f"`{step.name}`"
        assert cells[2] == (f"`{step.role}`" if step.role else "(the flow)")
        for name in (*step.reads, *step.gathers, *step.state):
            assert f"`{name}`" in cells[3] + cells[4] + cells[5]
        assert (f"`{step.output}`" in cells[6]) == bool(step.output)
        assert cells[7].startswith(PLACEMENT[step.phase])


def test_docs_internals_shows_the_wiring_the_code_derives():
    with open(os.path.join(ROOT, "docs", "internals.md")) as f:
        assert wiring_table() in f.read(), "docs/internals.md does not show wiring_table(); paste it"
