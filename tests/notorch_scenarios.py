"""A numpy and JAX user's session in a fresh process, run by tests/test_no_torch.py as
``python -m tests.notorch_scenarios SCENARIO DIRECTORY``.

``numpy_and_jax`` runs every verb on numpy and jax trees and checks after each one that
torch was never imported; it prints ``ok``, or the first verb after which torch was
loaded. ``torch_saved`` restores a checkpoint of torch tensors as numpy arrays (no torch),
then ``as_saved``: the tensors it returns need torch, which it then imports."""

from __future__ import annotations

import contextlib
import io
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


class TorchImported(Exception):
    pass


def no_torch(step: str) -> None:
    if "torch" in sys.modules:
        raise TorchImported(f"torch was imported by: {step}")


def numpy_tree() -> dict:
    return {
        "w": (np.arange(12, dtype=np.float32).reshape(3, 4) / 7).astype(ml_dtypes.bfloat16),
        "f": np.linspace(0, 1, 10, dtype=np.float32),
        "i": np.arange(6, dtype=np.int64).reshape(2, 3),
        "u": np.array([1, 2, 255], dtype=np.uint8),
        "fp8": np.array([0.5, -2.0], dtype=ml_dtypes.float8_e4m3fn),
        "big": np.arange(3 << 20, dtype=np.float32).reshape(3, -1),  # large enough for huge pages
        "scalar": np.float32(2.5),
        "meta": {"step": 7, "lr": 0.1, "name": "run", "none": None, "flags": [True, False]},
    }


def same(a: dict, b: dict) -> None:
    for k in ("w", "f", "i", "u", "fp8", "big"):
        if a[k].dtype != b[k].dtype or a[k].tobytes() != b[k].tobytes():
            raise AssertionError(f"{k}: {b[k]!r} != {a[k]!r}")
    if b["meta"] != a["meta"] or float(b["scalar"]) != float(a["scalar"]):
        raise AssertionError(f"plain values differ: {b['meta']!r}, {b['scalar']!r}")


def cli(*argv: str) -> str:
    from tsckpt._cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    if code != 0:
        raise AssertionError(f"tsckpt {' '.join(argv)} exited {code}: {out.getvalue()}")
    return out.getvalue()


def numpy_and_jax(root: str) -> None:
    import tsckpt

    no_torch("import tsckpt")
    tree = numpy_tree()
    d = os.path.join(root, "np")
    tsckpt.save(d, tree)
    no_torch("save")
    same(tree, tsckpt.restore(d))
    no_torch("restore without a target")
    like = {k: (np.zeros_like(v) if isinstance(v, np.ndarray) else v) for k, v in tree.items()}
    same(tree, tsckpt.restore(d, like))
    no_torch("restore into numpy targets")
    same(tree, tsckpt.restore(d, like, casting="same_kind"))
    cast = tsckpt.restore(d, {**like, "f": np.zeros(10, np.float64)}, casting="safe", strict=False)
    if cast["f"].dtype != np.float64 or not np.array_equal(cast["f"], tree["f"]):
        raise AssertionError(f"cast: {cast['f']!r}")
    no_torch("restore with a cast")
    row = tsckpt.ShardedArray(np.zeros((1, 1 << 20), np.float32), (3, 1 << 20), (1, 0))
    parts = tsckpt.restore(d, {**like, "big": row, "i": tsckpt.ArraySpec((2, 3), np.int32)}, casting="same_kind")
    if not (np.array_equal(parts["big"].local, tree["big"][1:2]) and parts["i"].dtype == np.int32):
        raise AssertionError("ShardedArray and ArraySpec targets")
    same(tree, tsckpt.restore(d, as_saved=True))
    no_torch("restore into ShardedArray and ArraySpec targets, and as_saved")
    if tsckpt.open(d)["w"][1:, :2].tobytes() != tree["w"][1:, :2].tobytes():
        raise AssertionError("open: wrong region")
    tsckpt.metadata(d)
    no_torch("open and metadata")
    report = tsckpt.verify(d)
    if not report.ok:
        raise AssertionError(f"verify: {report}")
    no_torch("verify")
    if "w" not in cli("ls", d) or not cli("verify", d).startswith("OK") or "bfloat16" not in cli("show", d, "w[1]"):
        raise AssertionError("cli output")
    no_torch("the command line (ls, show, verify)")
    tsckpt.save_async(os.path.join(root, "async"), tree).result(timeout=120)
    same(tree, tsckpt.restore(os.path.join(root, "async")))
    no_torch("save_async")
    with tsckpt.CheckpointManager(os.path.join(root, "mgr")) as m:
        m.save(1, tree)
        m.save_async(2, tree)
        m.wait()
        same(tree, m.restore(None, like))
        same(tree, m.restore(1))
    no_torch("the manager's save, save_async and restore")
    st = os.path.join(root, "st")
    tsckpt.convert(d, st, to_format="safetensors")
    got = tsckpt.restore(st)
    if got["i"].tobytes() != tree["i"].tobytes():
        raise AssertionError("convert to safetensors")
    no_torch("convert to safetensors and restore it")

    mesh = Mesh(np.array(jax.devices()).reshape(2), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    x = jax.device_put(jnp.arange(4 << 20, dtype=jnp.float32).reshape(8, -1), sharding)
    jtree = {"x": x, "key": jax.random.key(3), "step": jnp.int32(5)}
    jd = os.path.join(root, "jax")
    tsckpt.save(jd, jtree)
    no_torch("save of a jax tree")
    back = tsckpt.restore(jd, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                               "key": jax.random.key(0), "step": jnp.int32(0)})
    if not (back["x"].sharding == sharding and np.array_equal(np.asarray(back["x"]), np.asarray(x))):
        raise AssertionError("jax restore")
    if not np.array_equal(jax.random.key_data(back["key"]), jax.random.key_data(jtree["key"])):
        raise AssertionError("jax key restore")
    tsckpt.restore(jd)
    if not np.array_equal(tsckpt.open(jd)["x"][2:4], np.asarray(x)[2:4]):
        raise AssertionError("jax open")
    if not tsckpt.verify(jd).ok:
        raise AssertionError("jax verify")
    no_torch("restore, open and verify of a jax tree")

    try:
        import orbax.checkpoint as ocp
    except ImportError:
        return
    od = os.path.join(root, "orbax")
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True)).save(od, args=ocp.args.PyTreeSave(jtree | {"n": 4}))
    no_torch("orbax's own save")  # not tsckpt's doing: the check below would not hold without it
    o = tsckpt.restore(od, {"x": np.zeros(x.shape, np.float32), "key": jax.random.key(0), "step": 0, "n": 0})
    if not (np.array_equal(o["x"], np.asarray(x)) and o["n"] == 4):
        raise AssertionError("orbax restore")
    if not (tsckpt.verify(od).ok and tsckpt.open(od)["x"][1].tobytes() == np.asarray(x)[1].tobytes()):
        raise AssertionError("orbax open, verify")
    cli("ls", od)
    no_torch("restore, open, verify and ls of an Orbax checkpoint")


def torch_saved(root: str) -> None:
    import subprocess

    d = os.path.join(root, "torch")
    make = "import torch, tsckpt, sys; tsckpt.save(sys.argv[1], {'t': torch.arange(4)})"
    subprocess.run([sys.executable, "-c", make, d], check=True, timeout=120)
    import tsckpt

    plain = tsckpt.restore(d)["t"]
    no_torch("restore of a torch-saved checkpoint as numpy")
    saved = tsckpt.restore(d, as_saved=True)["t"]
    print(f"{type(plain).__module__} {type(saved).__module__} {saved.tolist()} torch={'torch' in sys.modules}")


if __name__ == "__main__":
    try:
        {"numpy_and_jax": numpy_and_jax, "torch_saved": torch_saved}[sys.argv[1]](sys.argv[2])
    except TorchImported as e:
        print(e)
    else:
        print("ok")
