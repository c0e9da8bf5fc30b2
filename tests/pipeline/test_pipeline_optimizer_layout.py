"""The optimizer sees the module's parameters, whatever layout the pipelined runtime keeps.

The stacked runtime (identical layers ``[stages, virtual, layers, ...]``) and the cut program
(packed vectors per chunk) run the optax update on their own layout only when the optimizer
updates it as it would the module's tree (``leafwise.same_on_layout``); otherwise on the
module's tree (``update.ModuleView``). Before, a callable mask saw the stacked layout (GPT tiny:
the layer-norm scales, rank 4 when stacked, were decayed), LAMB's trust ratios were taken over
a stage's stacked layers, and a mask pytree was refused.
"""
import jax
import numpy as np
import optax
import pytest
from one_device import one_device_params

import models
from nnscaler_jax import Constraints, auto_parallel
from nnscaler_jax.pipeline.leafwise import same_on_layout

pytestmark = pytest.mark.slow
RTOL, ATOL = 1e-4, 1e-6  # float32, as the other pipeline tests

_ndim_mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)


def _train(name, opt, mesh_shape=(2, 4), axes=("stage", "data"), policy=None, steps=2):
    spec = models.get(name, "tiny", batch_size=16)
    variables, args = spec.init(jax.random.key(0)), spec.make_args()
    pm = auto_parallel(jax.make_mesh(mesh_shape, axes),
                       Constraints(pipeline_stages=2, microbatches=2, schedule="1f1b"),
                       policy=policy)(spec.module)
    step = pm.train_step(spec.loss_fn, opt)
    state = step.init(variables, *args)
    for _ in range(steps):
        state, _ = step(state, *args)
    want = one_device_params(spec, variables, args, opt, steps)
    return step, state, want


def _assert_same(got, want):
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    for (path, a), b in zip(flat, jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))


def _module_keys(opt_state):
    return {getattr(k, "key", None) for path, _ in
            jax.tree_util.tree_leaves_with_path(opt_state) for k in path}


@pytest.mark.parametrize("name,make_opt,policy", [
    # a callable mask on the stacked GPT (4 layer-norm scales were decayed)
    ("gpt", lambda p: optax.adamw(1e-2, eps=1e-3, weight_decay=0.5, mask=_ndim_mask), None),
    # per-leaf trust ratios, stacked runtime with tensor-parallel stages
    ("gpt", lambda p: optax.lamb(1e-2, eps=1e-3), "megatron"),
    # a mask pytree of the module's parameters on the packed cut program (was refused), after
    # a global-norm clip that bites
    ("t5", lambda p: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(
        1e-2, eps=1e-3, weight_decay=0.5, mask=_ndim_mask(p))), None),
])
def test_layout_dependent_optimizers_update_the_modules_tree(name, make_opt, policy):
    spec = models.get(name, "tiny", batch_size=16)
    opt = make_opt(spec.init(jax.random.key(0))["params"])
    shape, axes = ((2, 2, 2), ("stage", "data", "model")) if policy else ((2, 4),
                                                                            ("stage", "data"))
    step, state, want = _train(name, opt, shape, axes, policy)
    _assert_same(step.params(state), want)
    # the optimizer state mirrors the module's tree, not the runtime's layout
    keys = _module_keys(state["opt_state"])
    assert "stages" not in keys
    assert keys & set(want)


def test_a_layout_independent_optimizer_keeps_the_runtimes_layout():
    """Plain Adam updates the stacked layout as the module's tree: no detour (the state
    stays stacked), and the same result."""
    opt = optax.adam(1e-2, eps=1e-3)
    step, state, want = _train("gpt", opt)
    _assert_same(step.params(state), want)
    assert "stages" in _module_keys(state["opt_state"])


def test_same_on_layout_probe():
    """A toy layout that stacks two same-shaped leaves: what changes with stacking is caught."""
    tree = {"a": np.zeros((3, 4), np.float32), "b": np.zeros((3, 4), np.float32),
            "s": np.zeros((4,), np.float32)}  # leaves in order a, b, s

    def layout(avals):
        del avals
        to = lambda xs: {"ab": jax.numpy.stack([xs[0], xs[1]]), "s": xs[2]}
        back = lambda t: [t["ab"][0], t["ab"][1], t["s"]]
        return to, back

    shapes = [(2, 2), (2, 2), (2,)]
    check = lambda opt: same_on_layout(opt, tree, shapes, layout)
    assert check(optax.adam(1e-2))
    assert check(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)))
    # rank 2 leaves decayed: 'a' and 'b' are, their stack (rank 3) is not
    assert check(optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim == 2, p))) \
        is False
    assert check(optax.lamb(1e-2)) is False  # one trust ratio for a and b together
    assert check(optax.adamw(1e-2, mask={"a": True, "b": False, "s": False})) is False


@pytest.mark.parametrize("pivots", [(), ("h_*",)], ids=["stacked", "cut"])
def test_the_state_keeps_its_layout_across_steps(pivots):
    """``init`` lays Adam's moments out as the step returns them (split over the stage axis
    like their parameters): the second step reuses the first one's program. Before, ``init``
    replicated them (``zeros_like`` carries no sharding) and step 2 compiled the whole step
    again (GPT tiny, 2 stages x 4 data: 4.47 s at step 2, 0.025 s after)."""
    spec = models.get("gpt", "tiny", batch_size=16)
    variables, args = spec.init(jax.random.key(0)), spec.make_args()
    pm = auto_parallel(jax.make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, microbatches=2, schedule="1f1b",
                                   pipeline_pivots=pivots))(spec.module)
    step = pm.train_step(spec.loss_fn, optax.adam(1e-3))
    state = step.init(variables, *args)
    layout = lambda s: [(jax.tree_util.keystr(p), x.sharding.spec)
                        for p, x in jax.tree_util.tree_flatten_with_path(s)[0]]
    before = layout(state)
    assert any("'stage'" in str(spec) for path, spec in before if ".mu" in path)
    state, _ = step(state, *args)
    assert layout(state) == before  # the same program's input again: no second compile
