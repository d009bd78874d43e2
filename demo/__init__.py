"""The demo's fixtures, kept out of the runtime path: the larger-of-two-digits task and its rule
reward, tiny models built from configs, the format warm start, and the experiment they make.

Only the CLI (``ppoflow demo``) and the deployment's embedded default import this package; the
flow, the tasks and the workers never do.
"""
