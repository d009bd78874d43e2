"""Experiment state on storage, and what a person sees of it.

manifest.py     ``manifest.json`` (what is committed)
paths.py        the experiment's layout: every URL joined inside its root
lock.py         one run at a time per experiment (``lock.json``)
metrics.py      per-iteration metrics: batch statistics, rank reduction, the headline lines
evaluation.py   held-out evaluation results and where they are kept
plots.py        the training curves as one PNG
retention.py    which checkpoints are kept, and their sizes
rollback.py     moving an experiment back to an earlier committed iteration
promotion.py    the promoted policy: the rule, the published directory, the records
tensorboard.py  TensorBoard event files of the metrics (optional)
tracking.py     MLflow tracking (optional), and what every tracker shares
wandb_tracking.py  Weights & Biases tracking (optional: ``tracking.wandb``)
"""
