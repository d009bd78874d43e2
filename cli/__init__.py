"""ppoflow.cli: the ``ppoflow`` command line, a terminal over the flows.

main.py       the parser, ``run`` / ``demo`` / ``eval`` (the flows run in this process), the entry point
verl.py       ``run``'s arguments and config: a file, its ``verl:`` section, ``--verl``, ``--set``; veRL's length
commands.py   the commands that read or change an experiment on storage: status, export-hf, rollback, ...
promotion.py  ``ppoflow promote``
data.py       ``ppoflow data``: training files from a task library (reasoning-gym)
queue_status.py  the rollout queue of asynchronous training, as ``ppoflow status`` shows it
demo.py       ``ppoflow demo``: build the demo experiment, train it, say where everything is
console.py    what the terminal shows while a run goes on, and the summary at its end
failure.py    the one error block of a failed or stopped run
local_api.py  the local Prefect API server of a run when no ``PREFECT_API_URL`` is set
__main__.py   ``python -m ppoflow.cli``

The CLI imports the flows (``ppoflow.flows``); nothing below it imports the CLI.
``python -m ppoflow.cli ARGS`` is the ``ppoflow`` console script.
"""
