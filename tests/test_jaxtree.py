"""JAX's pytree registry (tsckpt._base.jaxtree): Flax and optax containers flatten and rebuild as JAX says."""

from __future__ import annotations

import numpy as np
import pytest

import tsckpt
from tsckpt.tree import flatten

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
struct = pytest.importorskip("flax.struct")
train_state = pytest.importorskip("flax.training.train_state")


class Model(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])
        self.bn = nnx.BatchNorm(4, rngs=rngs)


@struct.dataclass
class Config:
    scale: jax.Array
    fn: object = struct.field(pytree_node=False, default=None)


@pytest.mark.slow(reason="Flax NNX models built and run: JAX compiles")
def test_nnx_state_paths_are_the_states_own_names():
    paths = flatten(nnx.state(Model(nnx.Rngs(0)))).paths
    assert paths == ["bn/bias", "bn/mean", "bn/scale", "bn/var", "layers/0/bias", "layers/0/kernel",
                     "layers/1/bias", "layers/1/kernel", "linear/bias", "linear/kernel"]


def test_nnx_model_and_optimizer_restore_into_abstract_state(ckdir):
    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    state = {"model": nnx.state(model), "opt": nnx.state(opt)}
    tsckpt.save(ckdir, state)
    assert "opt/opt_state/0/mu/linear/kernel" in tsckpt.open(ckdir).checkpoint.leaves

    def fresh():
        m = Model(nnx.Rngs(1))
        return {"model": nnx.state(m), "opt": nnx.state(nnx.Optimizer(m, optax.adamw(1e-3), wrt=nnx.Param))}

    out = tsckpt.restore(ckdir, jax.eval_shape(fresh))
    assert type(out["model"]) is type(state["model"])
    assert type(out["model"]["linear"]["kernel"]) is nnx.Param
    for (p, a), (q, b) in zip(jax.tree_util.tree_leaves_with_path(out), jax.tree_util.tree_leaves_with_path(state)):
        assert p == q and np.array_equal(np.asarray(a), np.asarray(b)), p
    target = Model(nnx.Rngs(2))
    nnx.update(target, out["model"])
    assert np.array_equal(np.asarray(target.linear.kernel[...]), np.asarray(model.linear.kernel[...]))
    plain = tsckpt.restore(ckdir)  # no target: nested dicts of the same names
    assert sorted(plain["model"]["linear"]) == ["bias", "kernel"]
    assert isinstance(plain["model"]["layers"], dict) and sorted(plain["model"]["layers"]) == [0, 1]


def test_static_fields_are_not_leaves(ckdir):
    cfg = Config(jnp.ones(2), fn=len)
    assert flatten(cfg).paths == ["scale"]
    tsckpt.save(ckdir, {"cfg": cfg})
    out = tsckpt.restore(ckdir, {"cfg": Config(jnp.zeros(2), fn=len)})["cfg"]
    assert type(out) is Config and out.fn is len and out.scale.tolist() == [1.0, 1.0]


def test_train_state(ckdir):
    import flax.linen as nn

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x)

    params = Dense().init(jax.random.key(0), jnp.ones((1, 2)))["params"]
    ts = train_state.TrainState.create(apply_fn=Dense().apply, params=params, tx=optax.adamw(1e-3))
    paths = flatten(ts).paths
    assert paths[:3] == ["step", "params/Dense_0/bias", "params/Dense_0/kernel"]
    assert not any("apply_fn" in p or p.startswith("tx") for p in paths)
    tsckpt.save(ckdir, ts.replace(step=7))
    out = tsckpt.restore(ckdir, ts)
    assert type(out) is train_state.TrainState and out.step == 7 and out.apply_fn is ts.apply_fn and out.tx is ts.tx
    assert type(out.opt_state[0]) is type(ts.opt_state[0])  # optax's own state classes
    assert np.array_equal(np.asarray(out.params["Dense_0"]["kernel"]), np.asarray(params["Dense_0"]["kernel"]))


def test_jax_types_optree_knows_keep_optree_rules():
    """dicts, lists, tuples and namedtuples are flattened as without jax (e.g. str keys that read as ints escaped)."""
    state = optax.adam(1e-3).init({"w": jnp.zeros(2)})
    assert flatten(state).paths == ["0/count", "0/mu/w", "0/nu/w"]
    assert flatten({"0": jnp.zeros(1), 1: jnp.zeros(1)}).paths == ["1", "%30"]


def test_orbax_names_keep_the_value_level_and_int_keys_as_strings():
    """Orbax's names (tree.ORBAX_NAMES): a Variable's `value` level kept, an int dict key (an
    nnx.List's, a plain dict's) the string of its digits; a sequence index stays a number."""
    from tsckpt.tree import ORBAX_NAMES

    state = nnx.state(Model(nnx.Rngs(0)))
    assert "layers/0/kernel" in flatten(state).paths
    orbax = flatten({"m": state, "d": {3: 1}, "s": (optax.EmptyState(), [2])}, names=ORBAX_NAMES).paths
    assert {"m/layers/%30/kernel/value", "m/linear/bias/value", "d/%33", "s/1/0"} <= set(orbax)
    assert not any(p.startswith("m/layers/0") for p in orbax)
