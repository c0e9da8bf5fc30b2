"""The search sees the user's Constraints when reached through auto_parallel."""

import fnmatch

import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, PlanError, Rule, auto_parallel


def test_memory_budget_reaches_the_search():
    module, make_args, _ = models.get("mlp", "tiny")
    (x,) = make_args()
    pm = auto_parallel(make_mesh((2, 4), ("data", "model")),
                       Constraints(max_memory_per_device=16), policy="auto")(module)
    with pytest.raises(PlanError, match="smallest"):
        pm.make_plan(x)


def test_rules_reach_the_search():
    module, make_args, _ = models.get("mlp", "tiny")
    (x,) = make_args()
    rules = (Rule(module="fc*", replicate=True),)
    plan = auto_parallel(make_mesh((2, 4), ("data", "model")), Constraints(rules=rules),
                         policy="auto")(module).make_plan(x)
    fc = [p for p in plan.ops if fnmatch.fnmatchcase(p.module_path, "fc*")]
    assert fc and all(p.split == () for p in fc)
