"""docs/errors.md, row by row: each documented bad input raises the documented class with a
message containing the documented text (or, for a ``UserWarning`` row, warns it; for a
``none`` row, runs).

Every row's id names a trigger below (``@trigger("row-id")``) that makes that bad input; the
test fails for a row without a trigger and for a trigger without a row. Rows whose trigger
compiles an XLA program are marked slow.
"""

from __future__ import annotations

import builtins
import functools
import json
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from custom_prims import softsign_primitive
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import make_mesh

from nnscaler_jax import (
    Constraints,
    Plan,
    Rule,
    auto_parallel,
    errors,
    op_assign,
    op_trans,
    register_rule,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
ROW = re.compile(r"^\|\s*`(?P<id>[a-z0-9-]+)`\s*\|(?P<cells>.*)\|\s*$")
SLOW = {"variables-on-other-devices", "variables-on-other-devices-jit"}


@dataclass(frozen=True)
class Row:
    id: str
    cls: str    # an errors class, a builtin exception / warning, or 'none'
    text: str   # what the message contains ('' for 'none' rows)


def _rows() -> list[Row]:
    """The rows of every table in docs/errors.md: | `id` | input | `Class` | `text` ... | fix |."""
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m is None:
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", m["cells"])]
        assert len(cells) == 4, f"row {m['id']}: want 5 cells (id, input, class, message, " \
                                f"fix), got {len(cells) + 1}: {line}"
        cls = re.fullmatch(r"`(\w+)`", cells[1])
        assert cls, f"row {m['id']}: the class cell is one `Name`, got {cells[1]!r}"
        text = re.search(r"`([^`]+)`", cells[2])
        assert cls[1] == "none" or text, f"row {m['id']}: no `message text` in {cells[2]!r}"
        rows.append(Row(m["id"], cls[1], text[1].replace("\\|", "|") if text else ""))
    return rows


ROWS = _rows()
TRIGGERS: dict[str, Callable[[], object]] = {}


def trigger(row_id: str) -> Callable:
    def register(fn: Callable[[], object]) -> Callable[[], object]:
        assert row_id not in TRIGGERS, f"two triggers for {row_id}"
        TRIGGERS[row_id] = fn
        return fn
    return register


# ---- small models and meshes -------------------------------------------------------------------

class TwoDense(nn.Module):
    """``fc1`` (-> 8) -> relu -> ``fc2`` (-> 4)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(4, name="fc2")(nn.relu(nn.Dense(8, name="fc1")(x)))


@functools.cache
def _mesh(shape=(2, 4), names=("data", "model")):
    return make_mesh(shape, names)


def _x(batch: int = 8) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((batch, 16), jnp.float32)


def _plan(constraints=None, *, batch: int = 8, policy=None, plan=None):
    """Plan TwoDense on the 2 x 4 mesh (abstract args: nothing compiles)."""
    pm = auto_parallel(_mesh(), constraints, policy=policy, plan=plan)(TwoDense())
    return pm.make_plan(_x(batch))


def _rules(*rules, batch: int = 8):
    return _plan(Constraints(rules=rules), batch=batch)


@functools.cache
def _dp_plan_json() -> str:
    return _plan(policy="dp").to_json()


def _custom_prim_module(name: str) -> nn.Module:
    prim = softsign_primitive(name)

    class WithCustomPrim(nn.Module):
        @nn.compact
        def __call__(self, x):
            return prim.bind(nn.Dense(8, name="fc")(x))

    return WithCustomPrim()


@functools.cache
def _variables():
    pm = auto_parallel(_mesh(), policy="dp")(TwoDense())
    return pm, pm.init(jax.random.key(0), jnp.ones((8, 16)))


def _gpt():
    import models

    return models.get("gpt", "tiny")


# ---- Constraints and auto_parallel arguments ---------------------------------------------------

@trigger("zero-out-of-range")
def _():
    Constraints(zero=5)


@trigger("microbatches-not-positive")
def _():
    Constraints(microbatches=0)


@trigger("pipeline-stages-not-positive")
def _():
    Constraints(pipeline_stages=0)


@trigger("memory-bad-size")
def _():
    Constraints(max_memory_per_device="32 gigs")


@trigger("unknown-schedule")
def _():
    Constraints(schedule="zigzag")


@trigger("overlap-on-per-stage")
def _():
    Constraints(pipeline_overlap=True, pipeline_executor="per-stage")


@trigger("unknown-precision")
def _():
    Constraints(precision="int8")


@trigger("rules-not-a-tuple")
def _():
    Constraints(rules=Rule(module="fc1", replicate=True))


@trigger("rules-not-rules")
def _():
    Constraints(rules=("fc1",))


@trigger("rule-names-as-string")
def _():
    Rule(module="fc1", axes="model")


@trigger("logical-rules-not-pairs")
def _():
    Constraints(logical_rules=("embed", "model"))


@trigger("unknown-policy")
def _():
    _plan(policy="fsdp")


@trigger("policy-returns-no-plan")
def _():
    def my_policy(graph, mesh):
        graph.finish()  # forgot the return

    _plan(policy=my_policy)


@trigger("constraints-not-constraints")
def _():
    auto_parallel(_mesh(), {"zero": 3})


@trigger("not-a-mesh")
def _():
    auto_parallel({"data": 2, "model": 4})


@trigger("pipeline-stages-without-stage-axis")
def _():
    _plan(Constraints(pipeline_stages=2))


# ---- rules against the model -------------------------------------------------------------------

@trigger("rule-unknown-axis")
def _():
    _rules(Rule(module="fc1", axes=("pipe",)))


@trigger("rule-matches-no-op")
def _():
    _rules(Rule(module="blk*/mlp", replicate=True))


@trigger("rule-dim-not-in-op")
def _():
    _rules(Rule(module="fc1", primitive="dot_general", dims=("zz",)))


@trigger("rule-size-not-divisible")
def _():
    _rules(Rule(module="fc1", primitive="dot_general", dims=("m0",), axes=("model",)), batch=6)


@trigger("rules-contradict-replicate")
def _():
    _rules(Rule(module="fc*", replicate=True), Rule(module="fc1", axes=("model",)))


@trigger("rules-contradict-dims")
def _():
    _rules(Rule(module="fc*", primitive="dot_general", dims=("m0",)),
           Rule(module="fc1", primitive="dot_general", dims=("n0",)))


@trigger("rules-contradict-axes")
def _():
    _rules(Rule(module="fc*", axes=("data",)), Rule(module="fc1", axes=("model",)))


@trigger("rule-contradicts-itself")
def _():
    _rules(Rule(module="fc1", replicate=True, axes=("model",)))


@trigger("recompute-rule-on-primitive")
def _():
    _rules(Rule(primitive="dot_general", recompute=True))


@trigger("recompute-rule-value")
def _():
    _rules(Rule(module="fc1", recompute="some"))


# ---- memory budget -----------------------------------------------------------------------------

@trigger("budget-nothing-fits")
def _():
    _plan(Constraints(max_memory_per_device=100))


@trigger("budget-builtin-policy-over")
def _():
    _plan(Constraints(max_memory_per_device=100), policy="dp")


# ---- shapes, annotations, your own policies ---------------------------------------------------

@trigger("unknown-primitive")
def _():
    auto_parallel(_mesh(), policy="dp")(_custom_prim_module("errors_table_softsign")).make_plan(
        _x())


@trigger("indivisible-batch")
def _():
    _plan(policy="dp", batch=7)


@trigger("register-rule-bad-annotation")
def _():
    register_rule("errors_table_unparsed", "a b -> (a")


@trigger("rule-does-not-fit-op")
def _():
    register_rule("errors_table_rank1", "a -> a")
    auto_parallel(_mesh(), policy="dp")(_custom_prim_module("errors_table_rank1")).make_plan(_x())


def _first_dot(graph):
    return next(op for op in graph.ops if op.primitive == "dot_general")


@trigger("op-trans-not-divisible")
def _():
    def split_batch_4(graph, mesh):
        op = _first_dot(graph)
        op_assign(graph, op_trans(graph, op, op.annotation.inputs[0].names()[0], 4), "model")
        return graph.finish()

    _plan(policy=split_batch_4, batch=6)


@trigger("op-trans-unknown-dim")
def _():
    def split_zz(graph, mesh):
        op_trans(graph, _first_dot(graph), "zz", 2)
        return graph.finish()

    _plan(policy=split_zz)


@trigger("op-assign-unknown-axis")
def _():
    def on_pipe(graph, mesh):
        op = _first_dot(graph)
        op_assign(graph, op_trans(graph, op, op.annotation.inputs[0].names()[0], 2), "pipe")
        return graph.finish()

    _plan(policy=on_pipe)


@trigger("module-fails-on-the-inputs")
def _():
    variables = jax.eval_shape(TwoDense().init, jax.random.key(0), _x())
    auto_parallel(_mesh(), policy="dp")(TwoDense()).make_plan(
        jax.ShapeDtypeStruct((8, 5), jnp.float32), variables=variables)


# ---- saved plans -------------------------------------------------------------------------------

@trigger("plan-json-corrupt")
def _():
    Plan.from_json('{"format": "nnscaler_jax.plan/1", "ops": [')


@trigger("plan-json-not-a-plan")
def _():
    Plan.from_json('{"policy": "dp"}')


@trigger("plan-file-missing")
def _():
    auto_parallel(_mesh(), plan="plans/missing.json")


@trigger("plan-wrong-type")
def _():
    auto_parallel(_mesh(), plan=5)


@trigger("plan-edited")
def _():
    d = json.loads(_dp_plan_json())
    d["ops"][0]["op"] = 999
    _plan(plan=json.dumps(d))


@trigger("plan-coshard-not-chunkable")
def _():
    d = json.loads(_dp_plan_json())
    d["coshard"] = [[d["ops"][0]["op"], "zz", 2]]
    _plan(plan=json.dumps(d))


@trigger("plan-of-another-model")
def _():
    pm = auto_parallel(_mesh(), plan=_dp_plan_json())(nn.Dense(4))
    pm.make_plan(_x())


@trigger("plan-of-another-mesh")
def _():
    other = make_mesh((4, 2), ("data", "model"))
    auto_parallel(other, plan=_dp_plan_json())(TwoDense()).make_plan(_x())


@trigger("plan-sizes-not-divisible")
def _():
    _plan(plan=_dp_plan_json(), batch=3)


@trigger("plan-precision-conflict")
def _():
    auto_parallel(_mesh(), Constraints(precision="bfloat16"), plan=_dp_plan_json())(TwoDense())


# ---- calling the wrapper -----------------------------------------------------------------------

@trigger("wrap-not-a-module")
def _():
    auto_parallel(_mesh())(lambda x: x)


@trigger("linen-wrapper-called")
def _():
    auto_parallel(_mesh())(TwoDense())(jnp.ones((8, 16)))


@trigger("plan-before-a-call")
def _():
    return auto_parallel(_mesh())(TwoDense()).plan


@trigger("unhashable-static-argument")
def _():
    auto_parallel(_mesh())(TwoDense()).init(jax.random.key(0), jnp.ones((8, 16)), {"fast", "exact"})


@trigger("variables-on-other-devices")
def _():
    pm, variables = _variables()
    elsewhere = jax.device_put(variables, jax.devices()[5])
    out = pm.apply(elsewhere, jnp.ones((8, 16)))
    assert out.sharding.mesh.shape == dict(_mesh().shape)  # moved onto the wrapper's mesh


@trigger("variables-on-other-devices-jit")
def _():
    pm, variables = _variables()
    other = jax.make_mesh((4,), ("data",), devices=jax.devices()[4:8])  # half of the devices
    elsewhere = jax.device_put(variables, NamedSharding(other, P()))
    jax.jit(lambda v: pm.apply(v, jnp.ones((8, 16))).sum())(elsewhere)


# ---- training steps and checkpoints ------------------------------------------------------------

@trigger("train-step-before-init")
def _():
    spec = _gpt()
    step = auto_parallel(_mesh())(spec.module).train_step(spec.loss_fn, optax.adamw(1e-3))
    step({}, *spec.make_args())


@trigger("train-step-microbatches-not-dividing")
def _():
    spec = _gpt()
    pm = auto_parallel(_mesh(), Constraints(microbatches=3))(spec.module)
    step = pm.train_step(spec.loss_fn, optax.adamw(1e-3))
    step.init({}, *spec.make_args(batch_size=8, abstract=True))


def _pipelined_gpt(preset: str, **options):
    import models

    spec = models.get("gpt", preset, batch_size=8)
    pm = auto_parallel(_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, microbatches=2))(spec.module)
    return spec, pm.train_step(spec.loss_fn, optax.sgd(0.1), **options)


@trigger("pipelined-step-empty-collection")
def _():
    spec, step = _pipelined_gpt("tiny")
    step.init({"params": {}, "batch_stats": {}}, *spec.make_args())


@trigger("pipelined-step-dropout-without-key")
def _():
    spec, step = _pipelined_gpt("tiny-dropout", module_kwargs={"deterministic": False})
    step.init(spec.init(jax.random.key(0)), *spec.make_args())


def _checkpoint(state) -> str:
    from nnscaler_jax.train.checkpoint import Checkpointer

    directory = tempfile.mkdtemp(prefix="errors_table_")
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
    return directory


def _restore(directory, target):
    from nnscaler_jax.train.checkpoint import Checkpointer

    with Checkpointer(directory) as ckpt:
        return ckpt.restore(target=target)


@trigger("checkpoint-of-another-model")
def _():
    directory = _checkpoint({"w": jnp.arange(8.0)})
    _restore(directory, {"w": jnp.zeros(5)})


@trigger("checkpoint-missing")
def _():
    _restore(tempfile.mkdtemp(prefix="errors_table_empty_"), {"w": jnp.zeros(8)})


@trigger("checkpoint-on-another-mesh")
def _():
    directory = _checkpoint({"w": jax.device_put(jnp.arange(8.0),
                                                 NamedSharding(_mesh(), P("data")))})
    other = make_mesh((4, 2), ("data", "model"))
    target = {"w": jax.device_put(jnp.zeros(8), NamedSharding(other, P("model")))}
    restored, _ = _restore(directory, target)
    assert restored["w"].sharding == target["w"].sharding
    assert restored["w"].tolist() == list(range(8))


# ---- the tests ---------------------------------------------------------------------------------

def _class(name: str) -> type:
    cls = getattr(errors, name, None) or getattr(builtins, name, None)
    assert isinstance(cls, type), f"docs/errors.md names an unknown class {name!r}"
    return cls


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=[pytest.mark.slow]
                                              if r.id in SLOW else []) for r in ROWS])
def test_documented_input_gives_documented_error(row: Row):
    fn = TRIGGERS.get(row.id)
    assert fn is not None, f"docs/errors.md row {row.id!r} has no trigger in this file"
    if row.cls == "none":
        fn()
        return
    cls = _class(row.cls)
    if issubclass(cls, Warning):
        with pytest.warns(cls) as record:
            fn()
        messages = [str(w.message) for w in record if isinstance(w.message, cls)]
        assert any(row.text in m for m in messages), (row.text, messages)
        return
    with pytest.raises(BaseException) as info:
        fn()
    assert type(info.value) is cls, (
        f"{row.id}: documented {row.cls}, raised {type(info.value).__name__}: {info.value}")
    assert row.text in str(info.value), (
        f"{row.id}: documented text {row.text!r} is not in the message:\n{info.value}")


def test_every_trigger_has_a_row_and_ids_are_unique():
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert set(TRIGGERS) <= set(ids), f"triggers without a row: {sorted(set(TRIGGERS) - set(ids))}"
    assert len(ids) >= 30


def test_plan_errors_are_the_package_classes():
    """Every row of a package error names a PlanError class (so ``except PlanError`` holds)."""
    for r in ROWS:
        cls = getattr(errors, r.cls, None)
        if cls is not None:
            assert issubclass(cls, errors.PlanError)
