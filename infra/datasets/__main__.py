"""``python -m ppoflow.infra.datasets reasoning-gym ...``: ``ppoflow data ...`` without the CLI."""

from ppoflow.infra.datasets.commands import main

raise SystemExit(main())
