"""Scenarios of a multi-process JAX job (2 processes x 2 CPU devices on 127.0.0.1), run by
tests/test_jaxcoord.py as ``python -m tests.jax_scenarios SCENARIO PROCESS PORT DIRECTORY``.

Each process prints one line, ``ok`` or the error's type and message, so the test can
assert what every process raised."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import tsckpt  # noqa: E402

SHAPE = (8, 12)
SPECS = {"rows": P(("p", "d")), "cols": P(None, ("p", "d")), "grid": P("p", "d"), "replicated": P()}


def values(name: str) -> np.ndarray:
    return np.arange(96, dtype=np.float32).reshape(SHAPE) * (1 + list(SPECS).index(name))


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 2), ("p", "d"))  # process-major: a row per process


def sharded(name: str) -> jax.Array:
    x = values(name)
    return jax.make_array_from_callback(SHAPE, NamedSharding(mesh(), SPECS[name]), lambda idx: x[idx])


def targets() -> dict:
    return {name: jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=NamedSharding(mesh(), spec))
            for name, spec in SPECS.items()}


def check(out: dict, plus: float = 0) -> None:
    for name in SPECS:
        arr = out[name]
        assert arr.sharding == NamedSharding(mesh(), SPECS[name]), name
        for shard in arr.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), values(name)[shard.index] + plus), name


def save(directory: str) -> None:
    tree = {name: sharded(name) for name in SPECS}
    tree["key"] = jax.random.key(4)
    tree["step"] = 3
    tsckpt.save(directory, tree)
    out = tsckpt.restore(directory, {**targets(), "key": jax.random.key(0), "step": 0})
    check(out)
    assert out["step"] == 3 and np.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(jax.random.key(4)))


def restore(directory: str) -> None:
    check(tsckpt.restore(directory, {**targets(), "key": jax.random.key(0), "step": 0}))


def restore_cols(directory: str) -> None:
    """The column-sharded array alone (what the DTensor scenario wrote)."""
    out = tsckpt.restore(directory, {"cols": targets()["cols"]})
    for shard in out["cols"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), values("cols")[shard.index])


def manager(directory: str) -> None:
    """The manager under jax.distributed: async saves, each followed at once by a jitted step that
    donates the saved arrays (each process stages its own shards), retention by process 0, the
    latest step restored."""
    tree = {name: sharded(name) for name in SPECS}
    step = jax.jit(lambda t: jax.tree.map(lambda a: a + 1, t), donate_argnums=0)
    with tsckpt.CheckpointManager(directory, keep_last=1) as m:
        # one process (0) deletes and cleans: every process knows its own rank
        assert m._rank == jax.process_index(), (m._rank, jax.process_index())
        m.save_async(1, {**tree, "step": 1})
        tree = step(tree)
        handle = m.save_async(2, {**tree, "step": 2})
        # this process's distinct shards: rows, cols, grid 1 of 2 shards; replicated 1; a row of the grid
        assert handle.staged_bytes == 96 * 4 * (3 / 2 + 1), handle.staged_bytes
        tree = step(tree)
        handle.result()
        m.wait()
        out = m.restore(target={**targets(), "step": 0})
        assert m.all_steps() == [2], m.all_steps()
    check(out, plus=1)
    assert out["step"] == 2


# shardings whose process's shards do not form one box: process 0 holds row blocks 0 and 2 of
# an interleaved device order, and column blocks 0 and 2 of ('model', 'data') over a process-major mesh
ODD = {"interleaved": P("x"), "model_data": P(None, ("model", "data"))}


def odd_mesh(name: str) -> Mesh:
    devices = np.array(jax.devices())
    if name == "interleaved":
        return Mesh(devices[[0, 2, 1, 3]], ("x",))
    return Mesh(devices.reshape(2, 2), ("data", "model"))


def odd_values(name: str) -> np.ndarray:
    return np.arange(96, dtype=np.float32).reshape(SHAPE) - 40 * (1 + list(ODD).index(name))


def _odd_check(out: dict, shardings: dict) -> None:
    for name, sharding in shardings.items():
        assert out[name].sharding == sharding, name
        for shard in out[name].addressable_shards:
            assert np.asarray(shard.data).tobytes() == odd_values(name)[shard.index].tobytes(), name


def odd_save(directory: str) -> None:
    """Arrays whose process's shards are not one box saved by both processes; each process's
    written boxes go to ``<directory>.writes<process>.json``. Restored into the same shardings
    and into process-major ones."""
    import json

    from tsckpt._save import write as _write

    written: list = []
    shard_writes = _write._shard_writes

    def recording(writes, records, where):
        for w in shard_writes(writes, records, where):
            written.append([w.item.path, list(w.offsets), list(w.lengths)])
            yield w

    _write._shard_writes = recording
    shardings = {name: NamedSharding(odd_mesh(name), spec) for name, spec in ODD.items()}
    tree = {name: jax.make_array_from_callback(SHAPE, sh, lambda idx, n=name: odd_values(n)[idx])
            for name, sh in shardings.items()}
    assert all(not any(s.index == tuple(slice(None) for _ in SHAPE) for s in a.addressable_shards) for a in tree.values())
    tsckpt.save(directory, tree)
    with open(f"{directory}.writes{jax.process_index()}.json", "w") as f:
        json.dump(written, f)
    odd_restore(directory)


def odd_restore(directory: str) -> None:
    for shardings in (
        {name: NamedSharding(odd_mesh(name), spec) for name, spec in ODD.items()},
        {name: NamedSharding(mesh(), P(("p", "d"))) for name in ODD},
    ):
        target = {name: jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sh) for name, sh in shardings.items()}
        _odd_check(tsckpt.restore(directory, target), shardings)


def keys(directory: str) -> None:
    """Typed keys (one, and 4 sharded over the global mesh) restored into targets replicated
    over the global mesh, and sharded over it."""
    key = jax.random.key(4)
    split = jax.random.split(jax.random.key(5), 4)
    sharding = NamedSharding(mesh(), P(("p", "d")))
    global_split = jax.make_array_from_single_device_arrays(
        (4,), sharding, [jax.device_put(split[idx], d) for d, idx in sharding.addressable_devices_indices_map((4,)).items()])
    tsckpt.save(directory, {"key": key, "keys": global_split})
    for spec in (P(), P(("p", "d"))):
        sharding = NamedSharding(mesh(), spec)
        target = {"key": jax.ShapeDtypeStruct((), key.dtype, sharding=NamedSharding(mesh(), P())),
                  "keys": jax.ShapeDtypeStruct((4,), key.dtype, sharding=sharding)}
        out = tsckpt.restore(directory, target)
        assert out["key"].sharding.is_equivalent_to(target["key"].sharding, 0), out["key"].sharding
        assert out["keys"].sharding.is_equivalent_to(sharding, 1), (out["keys"].sharding, sharding)
        for got, want in ((out["key"], key), (out["keys"], split)):
            assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
            for shard in got.addressable_shards:  # a key array's shard index also names the key data's axis
                index = shard.index[: want.ndim]
                assert np.array_equal(jax.random.key_data(shard.data), jax.random.key_data(want[index])), index


def main() -> None:
    scenario, process, port, directory = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process,
                               initialization_timeout=60)
    try:
        scenarios = {"save": save, "restore": restore, "restore_cols": restore_cols, "manager": manager,
                     "odd_save": odd_save, "odd_restore": odd_restore, "keys": keys}
        scenarios[scenario](directory)
        print("ok", flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(f"{type(e).__name__}: {e}".replace("\n", " "), flush=True)
    jax.distributed.shutdown()  # a barrier: the process serving the coordination service ends last


if __name__ == "__main__":
    main()


# ---- torch.distributed ranks (tests.dist_helpers.run_ranks) reading and writing the same checkpoints ----


def _dtensor_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,))


def dtensor_restore_cols(rank: int, world: int, directory: str) -> None:
    """The column-sharded array the JAX processes wrote, into a DTensor sharded by columns."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    target = distribute_tensor(torch.zeros(SHAPE), _dtensor_mesh(), [Shard(1)])
    out = tsckpt.restore(directory, {"cols": target}, strict=False)["cols"]
    assert torch.equal(out.to_local(), torch.from_numpy(values("cols"))[:, rank * 6 : rank * 6 + 6])


def dtensor_save_cols(rank: int, world: int, directory: str) -> None:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    tsckpt.save(directory, {"cols": distribute_tensor(torch.from_numpy(values("cols")), _dtensor_mesh(), [Shard(1)])})
