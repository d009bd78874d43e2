"""ppoflow: PPO for language models on PyTorch FSDP2 with vLLM rollouts; every iteration a Prefect flow.

The package's sub-packages live in the repository's top-level folders and are installed under this
one name (``pyproject.toml`` maps them), so nothing but ``ppoflow`` lands in site-packages:

    ppoflow.cli       the ``ppoflow`` command line: its commands, the terminal's output, the demo
    ppoflow.flows     Prefect flows: the iteration graph, the experiment session, the deployment entrypoints
    ppoflow.tasks     Prefect tasks: one per step of an iteration; inputs and outputs are URLs
    ppoflow.workers   code that runs inside the ranks: FSDP workers, actor/critic, rollout engines
    ppoflow.algos     pure tensor math: advantages, losses, KL penalties and controllers
    ppoflow.infra     data plane, rank runtime, experiment state, checkpoints, config, rewards
    ppoflow.demo      the demo's fixtures: its task and reward, tiny models, the format warm start

Layers import downward only: cli -> flows -> tasks -> workers -> algos, infra (the demo's builders
sit beside infra; only the CLI and the deployment's embedded default use them).
"""

__version__ = "0.2.0"
