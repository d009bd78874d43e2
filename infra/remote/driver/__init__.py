"""The driver's side of the remote-call layer (runs in the flow's process; imports no worker code).

group.py       WorkerGroup: N ranks of one worker class, called by method name
group_start.py the start: ranks accepted, and a failed start classified (can it work on retry?)
handle.py      WorkerHandle: a group's registered methods as attributes, typed by its contract
dp_split.py    DP_COMPUTE_PROTO: the input split by dp rank, the outputs (and metrics) merged
replies.py     waiting for one call's replies while watching the ranks and the launcher
launchers.py   the Launcher seam: LocalLauncher (torchrun on this host)
rendezvous.py  RendezvousLauncher: ranks on several nodes, started by their agents
hub.py         ClusterHub: the control endpoint agents and ranks dial, and the rendezvous store
slots.py       device slots: runs on one machine share its devices by file locks
"""
