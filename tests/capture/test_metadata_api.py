"""Flax partitioning metadata reaches the search through auto_parallel; boxed variables work."""

import flax.linen as nn
import jax
import numpy as np
from meshes import make_mesh

from nnscaler_jax import Constraints, auto_parallel


class MLP(nn.Module):
    kernel_init: tuple = (nn.initializers.lecun_normal(), nn.initializers.lecun_normal())

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, kernel_init=self.kernel_init[0], name="fc1")(x))
        return nn.Dense(16, kernel_init=self.kernel_init[1], name="fc2")(x)


def _check(module, rules=()):
    x = jax.random.normal(jax.random.key(1), (8, 32))
    pm = auto_parallel(make_mesh((2, 4), ("data", "model")), Constraints(logical_rules=rules),
                       policy="auto")(module)
    variables = pm.init(jax.random.key(0), x)
    ref_vars = module.init(jax.random.key(0), x)
    assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(ref_vars)
    out = pm.apply(variables, x)
    ref = module.apply(ref_vars, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(module.apply(variables, x)), np.asarray(ref),
                               atol=1e-5, rtol=1e-5)
    return pm.plan, variables


def test_with_partitioning_pins_storage():
    lecun = nn.initializers.lecun_normal()
    module = MLP((nn.with_partitioning(lecun, (None, "model")), lecun))
    plan, variables = _check(module)
    spec = plan.variable_spec("params/fc1/kernel")
    assert spec is not None and len(spec) == 2 and spec[1] in ("model", ("model",)), spec
    assert isinstance(variables["params"]["fc1"]["kernel"], nn.Partitioned)


def test_logical_partitioning_uses_logical_rules():
    lecun = nn.initializers.lecun_normal()
    module = MLP((lecun, nn.with_logical_partitioning(lecun, ("hidden", "out"))))
    plan, _ = _check(module, rules=(("hidden", "model"), ("out", None)))
    spec = plan.variable_spec("params/fc2/kernel")
    assert spec is not None and spec[0] in ("model", ("model",)), spec


def test_nnx_with_partitioning_pins_storage():
    """``nnx.with_partitioning`` metadata (the variables' ``sharding_names``) pins storage like
    linen's boxes: the kernels live split over 'model' as declared (a data-parallel plan, the
    search's own choice for this small MLP, would replicate them), outputs unchanged."""
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.fc1 = nnx.Linear(32, 64, kernel_init=nnx.with_partitioning(init, ("model", None)),
                                  rngs=rngs)
            self.fc2 = nnx.Linear(64, 16, kernel_init=nnx.with_partitioning(init, (None, "model")),
                                  rngs=rngs)

        def __call__(self, x):
            return self.fc2(jax.nn.relu(self.fc1(x)))

    mesh = make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                                        (jax.sharding.AxisType.Auto,) * 2)):
        module = Mlp(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 32))
    ref = np.asarray(module(x))
    pm = auto_parallel(mesh, policy="auto")(module)
    out = pm(x)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)
    for name, want in (("fc1/kernel", ("model", None)), ("fc2/kernel", (None, "model"))):
        spec = tuple(pm.plan.variable_spec(name) or ())
        spec = tuple(s[0] if isinstance(s, tuple) and len(s) == 1 else s for s in spec)
        assert spec == want, (name, spec)
