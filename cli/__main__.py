"""``python -m ppoflow.cli ARGS``: the ``ppoflow`` console script."""

import sys

from ppoflow.cli.main import main

sys.exit(main())
