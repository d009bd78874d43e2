"""``evaluate``: held-out responses of iteration n with its committed weights, scored.

During training (:mod:`ppoflow.flows.schedule`) the task runs for ``data.val_files`` after every
``evaluation.every``-th iteration, after the last iteration of a run (``evaluation.at_end``) and
for iteration 0 of a new experiment (``evaluation.before_training``), on the actor group while it
holds checkpoint n (the live weights right after update n: nothing is loaded). Its metrics join
iteration n's ``metrics.json`` (commit n waits for it); the responses are kept beside the
iteration (:mod:`ppoflow.infra.experiment.evaluation`). ``ppoflow eval`` and the ``ppo-eval``
flow run :func:`run_evaluation` on a group of their own, for any committed iteration.

Deterministic like every task: the prompts are the first ``evaluation.max_prompts`` rows of the
files in file order, decoding is greedy (or seeded with ``evaluation.seed``, the same for every
iteration), so a retried evaluation, or ``ppoflow eval`` of the same iteration, gives the same
responses and scores.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.data.prompts import PromptDataset, Row
from ppoflow.infra.experiment.evaluation import EVAL_DIR, VAL_TAG, evaluation_metrics
from ppoflow.infra.experiment.metrics import reduce_rank_metrics
from ppoflow.infra.remote.contracts import ACTOR_ROLE, ActorContract
from ppoflow.infra.rewards.remote import run_reward
from ppoflow.infra.rewards.rollout_batch import outcome_scores, outcome_texts
from ppoflow.tasks.receipts import Receipt
from ppoflow.tasks.run import get_run
from ppoflow.tasks.step import TASK_OPTIONS, Step, artifact_slug, ppo_task, shorten, task_logs

__all__ = [
    "evaluate",
    "evaluate_checkpoint",
    "run_evaluation",
    "evaluation_prompts",
    "decoding_summary",
    "score_responses",
    "samples_table",
    "due",
]


def due(cfg: ExperimentConfig, n: int, last_of_run: bool) -> bool:
    """Whether training evaluates iteration ``n`` (``n >= 1``)."""
    if not cfg.data.val_files:
        return False
    ev = cfg.evaluation
    return bool((ev.every and n % ev.every == 0) or (ev.at_end and last_of_run))


def evaluation_prompts(cfg: ExperimentConfig, dataset: PromptDataset, tokenizer: Any) -> DataProto:
    """The prompt batch of an evaluation: the first ``evaluation.max_prompts`` rows in file order,
    with the evaluation's sampling settings in ``meta_info`` (greedy unless ``temperature > 0``)."""
    ev = cfg.evaluation
    count = len(dataset) if ev.max_prompts is None else min(ev.max_prompts, len(dataset))
    sampled = ev.temperature > 0
    meta: dict[str, Any] = {
        "do_sample": sampled,
        "n": ev.n,
        "response_length": ev.response_length or cfg.rollout.response_length,
        "seed": ev.seed,
    }
    if sampled:
        meta.update(temperature=ev.temperature, top_p=ev.top_p, top_k=ev.top_k)
    prompts, _ = dataset.tokenize(
        [Row(0, i) for i in range(count)],
        tokenizer,
        prompt_length=cfg.rollout.prompt_length,
        apply_chat_template=cfg.data.apply_chat_template,
        meta_info=meta,
        truncation=cfg.data.truncation,
    )
    return prompts


def _prompt_text(raw: Any) -> str:
    """A prompt for people to read: a string, or the content of its chat messages."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, (list, tuple)):
        return "\n".join(str(m.get("content", "")) for m in raw if isinstance(m, dict))
    return str(raw)


def score_responses(
    cfg: ExperimentConfig, out: DataProto, tokenizer: Any
) -> tuple[DataProto, dict[str, float]]:
    """The responses of ``out`` (a rollout of :func:`evaluation_prompts`) decoded and scored with
    the reward functions: the generations table and the evaluation's metrics."""
    n = cfg.evaluation.n
    texts = outcome_texts(out, tokenizer)  # multi-turn: whole episodes, scored by their environment
    scores = outcome_scores(out, tokenizer, run_reward(cfg.reward), texts)
    nt = out.non_tensor_batch
    sources = [str(s) for s in nt["data_source"]]
    lengths = [int(m) for m in out.batch["response_mask"].sum(-1).tolist()]
    index = [i // n for i in range(len(texts))]
    table = DataProto.from_dict(
        non_tensors={
            "index": index,
            "sample": [i % n for i in range(len(texts))],
            "data_source": sources,
            "prompt": [_prompt_text(p) for p in nt["raw_prompt"]],
            "response": texts,
            "score": [float(s) for s in scores],
            "ground_truth": [None if g is None else str(g) for g in nt["ground_truth"]],
            "response_length": lengths,
        }
    )
    metrics = evaluation_metrics(index, sources, scores, lengths, n, cfg.evaluation.pass_threshold)
    return table, metrics


def evaluation_spec(cfg: ExperimentConfig, source: str, files: list[str]) -> dict[str, Any]:
    """What an evaluation's result depends on: the weights (a checkpoint's reference or a model
    directory), the files, how prompts become tokens, the engine's numerics (its dtype and tensor
    parallelism change greedy answers) and the settings; kept as ``spec.json`` beside its result."""
    rollout, data = cfg.rollout, cfg.data
    return {
        "source": source,
        "files": list(files),
        "evaluation": cfg.evaluation.model_dump(mode="json"),
        "rollout": {
            "engine": rollout.engine,
            "prompt_length": rollout.prompt_length,
            "response_length": rollout.response_length,
            "dtype": cfg.engine_dtype,
            "tensor_model_parallel_size": rollout.tensor_model_parallel_size,
        },
        "prompts": {
            "tokenizer": cfg.model.tokenizer,
            "prompt_key": data.prompt_key,
            "apply_chat_template": data.apply_chat_template,
            "truncation": data.truncation,
        },
        "reward": cfg.reward.model_dump(mode="json"),
    }


def decoding_summary(cfg: ExperimentConfig) -> str:
    """How the responses are made, in the terms another program must match to get the same ones
    (docs/evaluation.md: comparing with an evaluation outside ppoflow)."""
    ev, data = cfg.evaluation, cfg.data
    sampling = "greedy" if ev.temperature == 0 else f"temperature {ev.temperature}, seed {ev.seed}"
    prompts = "the tokenizer's chat template" if data.apply_chat_template else "plain text (no chat template)"
    return (
        f"{cfg.rollout.engine} in {cfg.engine_dtype}, {sampling}, up to "
        f"{ev.response_length or cfg.rollout.response_length} new tokens, prompts through {prompts}"
    )


def finished_evaluation(out_dir: str, spec: dict[str, Any]) -> dict[str, float] | None:
    """The metrics of the evaluation under ``out_dir`` if it was made with ``spec``, else None."""
    spec_url, metrics_url = storage.join(out_dir, "spec.json"), storage.join(out_dir, "metrics.json")
    if storage.exists(spec_url) and storage.exists(metrics_url) and storage.read_json(spec_url) == spec:
        return storage.read_json(metrics_url)
    return None


def run_evaluation(
    cfg: ExperimentConfig,
    worker: ActorContract,
    dataset: PromptDataset,
    tokenizer: Any,
    out_dir: str,
    spec: dict[str, Any],
) -> tuple[dict[str, float], dict[str, str]]:
    """Generate with ``worker`` (an actor group holding the weights to evaluate), score, and keep
    ``generations.arrow``, ``metrics.json`` and ``spec.json`` (written last) under ``out_dir``;
    the metrics and output URLs."""
    prompts_url = storage.join(out_dir, "prompts.arrow")
    rollout_url = storage.join(out_dir, "responses.arrow")
    evaluation_prompts(cfg, dataset, tokenizer).save(prompts_url)
    worker.generate_responses(prompts_url, out_url=rollout_url)
    out = DataProto.load(rollout_url)
    table, metrics = score_responses(cfg, out, tokenizer)
    engine = reduce_rank_metrics([out.meta_info.get("metrics") or {}])
    metrics.update({f"val/{k.split('/', 1)[-1]}": v for k, v in engine.items() if k.startswith("rollout/")})
    generations = storage.join(out_dir, "generations.arrow")
    table.save(generations)
    storage.write_json_atomic(storage.join(out_dir, "metrics.json"), metrics)
    for url in (prompts_url, rollout_url):  # the table holds what a person reads; the ids are redundant
        storage.rm(url)
    storage.write_json_atomic(storage.join(out_dir, "spec.json"), spec)
    return metrics, {"generations": generations, "metrics": storage.join(out_dir, "metrics.json")}


def samples_table(table: DataProto, rows: int) -> list[dict[str, Any]]:
    """The first ``rows`` generations as a Prefect table artifact's rows (texts shortened)."""
    nt = table.non_tensor_batch
    return [
        {
            "index": int(nt["index"][i]),
            "data_source": str(nt["data_source"][i]),
            "prompt": shorten(str(nt["prompt"][i])),
            "response": shorten(str(nt["response"][i])),
            "score": round(float(nt["score"][i]), 4),
        }
        for i in range(min(rows, len(table)))
    ]


@ppo_task("evaluate")
def evaluate(step: Step[Receipt], actor: str) -> Receipt:
    """Evaluate iteration ``n`` (the weights of the actor checkpoint ``actor``) on ``data.val_files``.

    Outputs ``generations``, ``metrics`` (``iterations/n/eval/val/``); metrics ``val/*``.
    """
    from prefect.artifacts import create_table_artifact

    cfg, ctx = step.cfg, step.ctx
    out_dir = step.file(f"{EVAL_DIR}/{VAL_TAG}")
    worker = step.worker(ACTOR_ROLE, actor)
    dataset = ctx.inputs.val_dataset(cfg.data.val_files)
    spec = evaluation_spec(cfg, step.paths.ref(actor) or actor, cfg.data.val_files)
    metrics, outputs = run_evaluation(cfg, worker, dataset, ctx.inputs.tokenizer, out_dir, spec)
    if cfg.evaluation.samples_shown:
        create_table_artifact(
            samples_table(DataProto.load(outputs["generations"]), cfg.evaluation.samples_shown),
            key=f"{step.slug}-evaluation",
            description=f"evaluation of iteration {step.n}: val/score {metrics['val/score']:.4g}",
        )
    step.logger.info(
        f"evaluation of iteration {step.n}: val/score {metrics['val/score']:.4f} over "
        f"{int(metrics['val/prompts'])} prompts ({outputs['generations']})"
    )
    return step.receipt(outputs=outputs, metrics=metrics)


@task(name="evaluate-checkpoint", task_run_name="evaluate-{tag}", **TASK_OPTIONS)
def evaluate_checkpoint(
    run: str, checkpoint: str | None, files: list[str], out_dir: str, tag: str
) -> dict[str, Any]:
    """``ppoflow eval`` / the ``ppo-eval`` flow: evaluate the actor weights of ``checkpoint`` (None:
    the config's ``model.path`` as it is) on ``files``; results under ``out_dir``. An evaluation
    already there with the same source, files and settings (``spec.json``) is returned as it is."""
    ctx = get_run(run)
    cfg = ctx.cfg
    spec = evaluation_spec(cfg, ctx.paths.ref(checkpoint) if checkpoint else cfg.model.path, files)
    done = finished_evaluation(out_dir, spec)
    if done is not None:
        return {"metrics": done, "out_dir": out_dir, "resumed": True}
    with task_logs(ctx, "actor") as logger:
        worker = ctx.groups.worker(ACTOR_ROLE, checkpoint, progress=logger.info)
        dataset = ctx.inputs.val_dataset(files)
        metrics, outputs = run_evaluation(cfg, worker, dataset, ctx.inputs.tokenizer, out_dir, spec)
        if cfg.evaluation.samples_shown:
            from prefect.artifacts import create_table_artifact

            create_table_artifact(
                samples_table(DataProto.load(outputs["generations"]), cfg.evaluation.samples_shown),
                key=f"{artifact_slug(cfg.storage.experiment)}-evaluation-{tag}",
                description=f"evaluation ({tag}) of {checkpoint or cfg.model.path}: val/score {metrics['val/score']:.4g}",
            )
    return {"metrics": metrics, "out_dir": out_dir, "resumed": False}
