"""A module a test group's launcher imports before it forks the ranks (``PPOFLOW_PRELOAD``)."""

import os

#: The pid of the process that imported this module.
IMPORTED_IN = os.getpid()
