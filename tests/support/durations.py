"""``tests/durations.json`` from a pytest ``--durations=0`` report of the slow tier:

    make test PYTEST_ARGS="--durations=0" | tee slow.log
    python -m tests.support.durations slow.log > tests/durations.json

Each test's seconds (setup, call and teardown together, so a shared run's build counts where it
happened) keyed by node id without xdist's ``@group`` suffix; ``tests/conftest.py`` sums them per
group to hand the longest groups out first.
"""

from __future__ import annotations

import json
import re
import sys

LINE = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(\S.*?)\s*$")


def durations(report: str) -> dict[str, float]:
    """Seconds per test node id in ``report`` (the text of a ``--durations=0`` run)."""
    total: dict[str, float] = {}
    for line in report.splitlines():
        m = LINE.match(line)
        if m:
            nodeid = m.group(2).rsplit("@", 1)[0] if "::" in m.group(2) else m.group(2)
            total[nodeid] = total.get(nodeid, 0.0) + float(m.group(1))
    return {k: round(v, 1) for k, v in sorted(total.items())}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tests.support.durations REPORT > tests/durations.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        table = durations(f.read())
    if not table:
        print(f"{args[0]}: no --durations lines (run pytest with --durations=0)", file=sys.stderr)
        return 1
    json.dump(table, sys.stdout, indent=0)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
