"""``python -m ppoflow.infra.datasets reasoning-gym ...``: the data commands on their own."""

from ppoflow.infra.datasets.commands import main

raise SystemExit(main())
