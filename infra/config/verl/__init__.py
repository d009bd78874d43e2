"""veRL's command line in ppoflow: ``ppoflow run --verl KEY=VALUE ...`` and a config's ``verl:``
section (docs/verl.md). A pure mapping: no file is read here.

    t = translate(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=5", ...])
    t.check()                      # VerlError naming every refused key, with the reason
    data = under(t.config, mine)   # the translation under a config's own sections

hydra.py      veRL's override syntax (key=value, +key, ++key, ~key) and nested ``verl:`` mappings
keys.py       every veRL key: mapped, checked (a value ppoflow does anyway, or refused) or ignored
translate.py  one command's translation: the keys sorted, the config it makes
translator.py the state the rules share: the command's values, what they set and decided
sections.py   the rules for data.*, actor_rollout_ref.* and critic.*
run.py        the rules for the reward keys and trainer.*
algorithm.py  the rules for algorithm.* (estimator, KL, rollout correction, DAPO's group filter)
"""

from ppoflow.infra.config.verl.hydra import VerlError, parse_overrides
from ppoflow.infra.config.verl.translate import Translation, translate, under

__all__ = ["VerlError", "Translation", "translate", "under", "parse_overrides"]
