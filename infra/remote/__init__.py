"""The remote-call layer: the driver (the flow's process) calls methods of worker classes that run
in groups of ranks started with torch's launcher, over authenticated JSON links, never pickle.

driver/          the driver's side: worker groups, DP split and merge, launchers, hub, device slots
rank/            the rank's side: its entry point, the Worker base class, seeding
agent/           a node's agent of a multi-node run
protocol.py      every message between driver, agents and ranks, as typed models
dispatch.py      dispatch modes and ``@register``, the table of a worker class's callable methods
contracts.py     each worker class's methods as the driver calls them (Protocols), worker modes, roles
metric_merge.py  how a method's metrics merge over data-parallel shards (the worker declares it)
links.py         the authenticated links and their listener
procs.py         torchrun's command line and environment, its output, killing what it started
cluster_key.py   the shared secret of a multi-node run
errors.py        RankFailure, WorkerGroupDead, and a rank's error as the driver classifies it
"""
