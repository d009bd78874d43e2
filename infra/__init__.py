"""ppoflow.infra: what the layers above share; it imports neither Prefect nor the layers above.

data/        the data plane: DataProto, its Arrow codec, fsspec storage, prompt datasets and the
             growing stream of training files, content hashes of stored files
datasets/    training files written from task libraries (reasoning-gym), the data commands
remote/      the remote-call layer: the wire protocol, dispatch modes, metric merge rules; driver/
             (worker groups, DP split and merge, launchers, the multi-node hub, device slots),
             rank/ (the rank's entry point, the Worker base class, seeding), agent/ (a node's agent)
experiment/  experiment state on storage: manifest, lock, metrics, plots, evaluation, retention,
             rollback, promotions, TensorBoard and MLflow tracking
queue/       the rollout queue of asynchronous training: policy versions, batches and their
             leases, the versions that sampled each token and the staleness bound
checkpoint/  sharded DCP checkpoints of the trained models (marker, hashes, background writer),
             export to Hugging Face (full and LoRA), GGUF import
config/      the experiment config: one pydantic tree, by section
envs/        multi-turn environments: the tools environment, OpenEnv servers, tools and the sandbox
preflight/   checks of an experiment before any worker group starts
architectures/  the model matrix: the architectures ppoflow supports, their tiny and real
             configs, and the check of a model's config against them
rewards/     rewards by data source (GSM8K/MATH by math-verify, reasoning-gym), custom rewards and
             batch scorers, reward services over HTTP, scoring rollouts
plugins/     the one loader of the user objects a config names by import path (``module:attr`` or a
             file path): rewards, environments and tools, admission policies
runtime/     what happens to a running process: SIGTERM / Ctrl-C handlers, the CPU a stretch of
             work got, fault drills (PPOFLOW_FAULT)
models/      where models come from and what serves them: Hugging Face hub ids and the hub's
             reachability, the registry of rollout engines (classes by import path, capabilities)
"""
