"""ppoflow.flows: the Prefect flows, and what they open around their tasks.

ppo.py         the ``ppo`` flow: more iterations of an experiment
schedule.py    the order of an iteration's tasks, pipelined commits, one-step overlap
session.py     ExperimentSession: lock, manifest, preflight, device slots, worker groups, tracker, plot
evaluate.py    the ``ppo-eval`` flow: a committed iteration or a model directory on held-out prompts
retrain.py     the ``ppo-retrain`` flow: train, evaluate, promote when a rule holds
deployment.py  the entrypoints ``prefect.yaml`` names, with the embedded default experiment
export.py      a committed iteration's policy as a Hugging Face directory (what a promotion publishes)
asynchronous/  asynchronous training: the queue as the run's rollout source, the producer process,
               the ``ppo-rollout`` flow and its ``produce`` task

The command line (``ppoflow.cli``) runs these flows; nothing here imports it.
"""
