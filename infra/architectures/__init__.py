"""The model architectures ppoflow supports, as data: one row each, what it was verified for, the
tiny configuration the tests build, the real small shape the GPU benchmark builds, and the config
check that refuses what cannot work before anything starts.

    row = architecture_of("qwen3_moe")              # by config.json's model_type (None: not in the matrix)
    cfg = tiny_config(row, vocab_size=261)          # transformers' own config class, random-weight tests
    problems, notes = config_problems(config_json, settings)   # preflight: what cannot run, and why

matrix.py    the rows (``Architecture``) and the lookups; pure data, no torch
tiny.py      transformers configs of a row: the tiny one (tests, hidden 64) and the real small shape
             (``ppoflow.demo.tiny_models.save_tiny_model(dir, arch=...)`` saves one with the tokenizer)
check.py     what a model's config.json and the run's settings ask of a row: refusals and notes

docs/models.md is the same matrix as a table, with the figures the tests measured.
"""

from ppoflow.infra.architectures.check import Settings, config_problems
from ppoflow.infra.architectures.matrix import ARCHITECTURES, Architecture, architecture_of, names
from ppoflow.infra.architectures.tiny import real_config, tiny_config

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "architecture_of",
    "names",
    "Settings",
    "config_problems",
    "tiny_config",
    "real_config",
]
