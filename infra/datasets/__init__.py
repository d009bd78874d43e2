"""Datasets the field's libraries generate, written as ppoflow's training files (veRL-format
parquet), by ``ppoflow data SOURCE ...`` (:mod:`ppoflow.cli.data`).

- :mod:`~ppoflow.infra.datasets.reasoning_gym`: reasoning-gym tasks, or a weighted mix, as
  train/held-out files with no question in both, scored by
  :mod:`ppoflow.infra.rewards.reasoning_gym`.
"""
