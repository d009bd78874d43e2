"""The rank's side of the remote-call layer (runs in each rank, started by torch's launcher).

launch.py   the launcher of a host's ranks: torchrun, CPU ranks forked from it after one import
__main__.py what a forked rank runs: the entry's main
entry.py    the rank's entry point: connect to the driver, build the worker, serve its calls
worker.py   Worker, the base class of every worker, with ``register``, ``Dispatch``, ``MetricRule``
seeding.py  seed_rngs: the start of the rank's python, numpy and torch generators
"""
