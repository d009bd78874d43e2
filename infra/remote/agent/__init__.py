"""The node agent (``ppoflow agent``): runs on each extra host of a multi-node run, dials the
driver's hub and starts, watches and kills that node's ranks for it.

node_agent.py  the agent's loop and its command line
"""
