"""Where a run's models come from and what serves them in rollouts, named without loading either:
the config and the preflight ask here in the flow's process, the ranks build what it names.

hf_hub.py           Hugging Face hub ids among model paths, and whether the hub can be reached
rollout_engines.py  the registry of rollout engines: name, classes by import path, capabilities
"""
