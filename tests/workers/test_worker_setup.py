"""A worker's first step: the experiment config from the group's config dict (a dict or its JSON
text, validated as in the flow) and a role among the worker class's."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from ppoflow.workers.worker_setup import parse_worker_config
from tests.support.configs import slots_config

ROLES = ("actor_rollout_ref", "ref")


def test_the_config_comes_back_as_the_flow_sent_it_and_the_role_is_checked():
    cfg = slots_config()
    sent = cfg.model_dump(mode="json")
    for config in ({"config": sent}, {"config": json.dumps(sent), "role": "ref"}):
        got, role = parse_worker_config(config, ROLES, "actor_rollout_ref")
        assert got == cfg and role == config.get("role", "actor_rollout_ref")
    with pytest.raises(ValueError, match="unknown role 'critic'; allowed: actor_rollout_ref, ref"):
        parse_worker_config({"config": sent, "role": "critic"}, ROLES, "actor_rollout_ref")
    with pytest.raises(KeyError, match="needs a 'config' entry"):
        parse_worker_config({"role": "ref"}, ROLES, "actor_rollout_ref")
    with pytest.raises(ValidationError, match="typo"):
        parse_worker_config({"config": {**sent, "typo": 1}}, ROLES, "actor_rollout_ref")
