"""ppoflow: PPO for language models on PyTorch FSDP2 with vLLM rollouts; every iteration a Prefect flow.

The package's sub-packages live in the repository's top-level folders and are installed under this
one name (``pyproject.toml`` maps them), so nothing but ``ppoflow`` lands in site-packages:

    cli/       the ``ppoflow`` command line: its commands, the terminal's output, the demo command
    flows/     Prefect flows: the iteration loop, the experiment session, evaluation, retraining, the deployment
    tasks/     Prefect tasks: one per step of an iteration; inputs and outputs are URLs
    workers/   code that runs inside the ranks: FSDP workers, actor/critic, rollout engines
    algos/     pure tensor math: advantages, losses, KL penalties and controllers
    infra/     data plane, the remote-call layer, experiment state, checkpoints, config, rewards
    demo/      the demo's fixtures: its task and reward, tiny models, the format warm start

Layers import downward only: cli -> flows -> tasks -> (workers, through the remote-call layer in
infra/remote) -> algos, infra. The flow's process (cli, flows, tasks) never imports workers: the
ranks do, started by import path. The demo's builders sit beside infra; only the CLI and the
deployment's embedded default use them. ``tests/test_package.py`` checks these rules.
"""

__version__ = "0.2.0"
