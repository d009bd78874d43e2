"""ppoflow.infra: what the layers above share, none of it Prefect- or rank-specific.

data/        the data plane: DataProto, its Arrow codec, fsspec storage, prompt datasets
datasets/    training files written from task libraries (reasoning-gym), the data commands
runtime/     the rank runtime: worker groups on torch's launcher, control channel, dispatch, fault drills
experiment/  experiment state on storage: manifest, lock, metrics, plots, TensorBoard, MLflow
checkpoint/  sharded DCP checkpoints of the trained models, and export to Hugging Face
config.py    the experiment config (one pydantic tree)
hub.py       hub ids among model paths, and whether the Hugging Face hub can be reached
host_cpu.py  the CPU a stretch of work got: the thread's own, the host's busy and stolen shares
rewards/     rewards by data source (GSM8K/MATH by math-verify, reasoning-gym), custom rewards and
             batch scorers, reward services over HTTP, scoring rollouts, the loader of user objects
envs/        multi-turn environments: the tools environment, OpenEnv servers, tools and the sandbox
"""
