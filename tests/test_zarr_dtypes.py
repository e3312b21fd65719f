"""tsckpt_zarr: zarr-python reads every array of every dtype tsckpt writes, to the bytes
TensorStore reads, fill values included; its names are TensorStore's; the entry points
name its classes; importing tsckpt imports neither it nor zarr."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch

import tsckpt
from tests.stored import array_store
from tests.strategies import tensor_from_bytes
from tsckpt._base import dtypes as tsdtypes

zarr = pytest.importorskip("zarr")
from zarr.core.dtype import data_type_registry  # noqa: E402

import tsckpt_zarr  # noqa: E402
from tsckpt_zarr.dtypes import DATA_TYPES, Float8E8M0FNU, Int4  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RNG = np.random.default_rng(37)
# zarr-python's own names (another test may have registered tsckpt_zarr's already)
BUILTIN = frozenset(k for k, v in data_type_registry.contents.items() if not v.__module__.startswith("tsckpt_zarr"))
BY_NAME = {cls._zarr_v3_name: cls for cls in DATA_TYPES}
FOUR_BIT = {"float4_e2m1fn", "int4"}


@pytest.fixture
def zarr_dtypes():
    """The data types registered for one test, and zarr-python's registry as it was afterwards."""
    before = dict(data_type_registry.contents)
    for name in set(before) - BUILTIN:
        del data_type_registry.contents[name]
    added = tsckpt_zarr.register()
    yield added
    data_type_registry.contents.clear()
    data_type_registry.contents.update(before)


def bits_of(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view({1: np.uint8, 2: np.uint16}[a.dtype.itemsize])


# ---- names ------------------------------------------------------------------------


def test_the_plugin_adds_exactly_the_storage_dtypes_zarr_python_lacks(zarr_dtypes):
    written = {tsdtypes.storage_dtype(name) for name in tsdtypes.LOGICAL_NAMES}
    assert set(zarr_dtypes) == written - BUILTIN == set(BY_NAME)
    assert tsckpt_zarr.register() == ()  # a second call adds nothing


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_names_are_tensorstores_and_ml_dtypes(name):
    store = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "memory"}, "metadata": {"shape": [3], "data_type": name}}, create=True
    ).result()
    zdtype = BY_NAME[name]()
    assert str(store.dtype.numpy_dtype) == name == str(zdtype.to_native_dtype())
    assert zdtype.to_json(zarr_format=3) == name
    assert zdtype.item_size == np.dtype(getattr(ml_dtypes, name)).itemsize
    assert type(BY_NAME[name].from_json(name, zarr_format=3)) is BY_NAME[name]


def test_zarr_format_2_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="zarr format 2 has no name for the data type bfloat16; create the array with zarr_format=3"):
        BY_NAME["bfloat16"]().to_json(zarr_format=2)


def test_names_and_meanings_are_in_the_format_doc():
    text = (ROOT / "docs" / "format.md").read_text()
    table = text[text.index("### Data types for zarr-python"):]
    for name in BY_NAME:
        assert f"| `{name}` |" in table, name
    assert "`float8_e4m3`" in table  # the zarr-extensions type that differs from float8_e4m3fn


# ---- a checkpoint of every dtype, read by zarr-python ------------------------------


def leaf_of(name: str, shape: tuple[int, ...]):
    """A leaf of logical dtype ``name`` with random bits: a torch tensor where torch has
    the dtype, else a numpy array of the ml_dtypes type (4-bit types: low 4 bits only)."""
    n = math.prod(shape)
    if name in tsdtypes.torch_dtypes() and name not in FOUR_BIT:
        dtype = tsdtypes.torch_dtypes()[name]
        return tensor_from_bytes(RNG.bytes(n * torch.empty((), dtype=dtype).element_size()), shape, dtype)
    dt = tsdtypes.numpy_dtype(name)
    raw = RNG.integers(0, 16 if name in FOUR_BIT else 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def every_dtype_tree():
    """Every logical dtype tsckpt accepts, as an array whose extents are not multiples of
    its chunks (so edge chunks are read), a 1-d array and a 0-d one."""
    return {name: {"m": leaf_of(name, (37, 91)), "v": leaf_of(name, (37,)), "s": leaf_of(name, ())}
            for name in tsdtypes.LOGICAL_NAMES}


def tensorstore_read(ckdir: str, leaf: str, layout: str) -> np.ndarray:
    base = {"driver": "file", "path": f"{ckdir}/"}
    kv = {**base, "path": f"{ckdir}/{leaf}/"} if layout == "plain" else {"driver": "ocdbt", "base": base, "path": f"{leaf}/"}
    return ts.open({"driver": "zarr3", "kvstore": kv}, read=True).result().read().result()


def zarr_python_array(ckdir: str, leaf: str, layout: str, export: Path):
    """The array through zarr-python: in the plain layout its own directory; zarr-python
    cannot read the compact layout's database, so there its keys, byte for byte, are
    copied into a directory first."""
    if layout == "plain":
        return zarr.open_array(os.path.join(ckdir, leaf), mode="r")
    kv = array_store(ckdir)
    prefix = f"{leaf}/".encode()
    for key in kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + b"0")).result():
        dest = export / leaf / key[len(prefix):].decode()
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(bytes(kv.read(key).result().value))
    return zarr.open_array(export / leaf, mode="r")


def test_zarr_python_reads_every_dtype_as_tensorstore_does(layout, tmp_path, small_chunks, zarr_dtypes):
    ckdir = str(tmp_path / "ck")
    tree = every_dtype_tree()
    tsckpt.save(ckdir, tree, layout=layout)
    flat = tsckpt.tree.flatten(tree)
    edge = 0
    for leaf in flat.paths:
        want = tensorstore_read(ckdir, leaf, layout)
        arr = zarr_python_array(ckdir, leaf, layout, tmp_path / "export")
        got = arr[...]
        assert got.dtype == want.dtype and got.shape == want.shape, leaf
        assert got.tobytes() == want.tobytes(), leaf
        if got.ndim >= 2:  # a box across shard and inner chunk edges, and the array's edge
            assert arr[4:29, 33:91].tobytes() == want[4:29, 33:91].tobytes(), leaf
            edge += any(s % c for s, c in zip(arr.shape, arr.shards or arr.chunks))  # a partial last shard
        if arr.dtype.name in BY_NAME:
            assert type(arr.metadata.data_type) is BY_NAME[arr.dtype.name], leaf
    assert edge == len(tree)


def test_zarr_python_lists_a_checkpoint_of_every_dtype(ckdir, zarr_dtypes):
    tree = every_dtype_tree()
    tsckpt.save(ckdir, tree)
    g = zarr.open_group(ckdir, mode="r")
    arrays = {name: node for name, node in g.members(max_depth=None) if isinstance(node, zarr.Array)}
    assert set(arrays) == set(tsckpt.tree.flatten(tree).paths)
    bf = arrays["bfloat16/m"][...]
    assert bf.dtype == np.dtype(ml_dtypes.bfloat16)
    assert bits_of(bf).tobytes() == tree["bfloat16"]["m"].view(torch.int16).numpy().tobytes()


# ---- fill values ------------------------------------------------------------------

FILL_FORMS = [0, -0.0, 1, 1.5, 3.3, -2.75, 448, 500, 1e30, -1e30, 1e-45, 2.0**-130,
              "NaN", "Infinity", "-Infinity", "0x00", "0x01", "0x0f", "0x7f", "0x80", "0xff", "0x1", "0x7fe0", "0xffc1",
              -8, -3, 7]


def tensorstore_array(path: Path, name: str, fill):
    """A TensorStore-written array of 5 elements in chunks of 2 with one element written:
    two chunks, the last one partial, are missing and read as the fill value."""
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/"},
            "metadata": {"shape": [5], "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2]}},
                         "data_type": name, "fill_value": fill}}
    try:
        store = ts.open(spec, create=True).result()
    except ValueError:
        return None  # a fill value TensorStore refuses for this type
    store[1].write(np.ones((), np.float32).astype(store.dtype.numpy_dtype) if name != "int4" else np.int8(1).astype(ml_dtypes.int4)).result()
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/"}}, read=True).result()


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_fill_values_read_to_tensorstores_bits(name, tmp_path, zarr_dtypes):
    checked = 0
    for i, fill in enumerate(FILL_FORMS):
        store = tensorstore_array(tmp_path / str(i), name, fill)
        if store is None:
            continue
        stored = json.loads((tmp_path / str(i) / "zarr.json").read_text())["fill_value"]
        want = store.read().result()
        got = zarr.open_array(tmp_path / str(i), mode="r")[...]
        assert got.dtype == want.dtype
        if name == "float8_e8m0fnu" and not isinstance(stored, str) and stored != 0:
            # TensorStore reads numbers for this type to other bits than ml_dtypes, torch and the
            # zarr-extensions definition (2.0 -> 0x40, not 0x80): the plugin follows the definition
            assert bits_of(got)[2] == np.asarray(stored, np.float32).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
            assert bits_of(got)[2] != bits_of(want)[2], "TensorStore now reads e8m0 numbers as defined: update docs/format.md"
        elif name == "int4":
            # the same values; TensorStore sign-extends a missing chunk's fill into the upper
            # 4 bits of each byte, ml_dtypes (through zarr-python) leaves them zero
            assert got.astype(np.int8).tolist() == want.astype(np.int8).tolist(), (fill, stored)
            assert (bits_of(got)[2:] >> 4).tolist() == [0] * 3  # the missing chunks
        else:
            assert bits_of(got).tolist() == bits_of(want).tolist(), (fill, stored)
        checked += 1
    assert checked >= (5 if name == "int4" else 15)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_fill_values_round_trip_and_tensorstore_reads_them(name, tmp_path, zarr_dtypes):
    """Every bit pattern (bfloat16: a sample with NaN payloads, infinities and -0) comes back
    from the plugin's JSON to the same bits, and TensorStore reads the JSON to them too."""
    zdtype = BY_NAME[name]()
    size = zdtype.item_size
    if name == "int4":
        for v in range(-8, 8):
            assert zdtype.to_json_scalar(zdtype.from_json_scalar(v, zarr_format=3), zarr_format=3) == v
        return
    if size == 1:
        patterns = list(range(16 if name in FOUR_BIT else 256))
    else:
        patterns = [0, 0x8000, 0x3F80, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7FC1, 0x7F81, 0xFFFF, 0x0001, 0x8001, 0x7F7F]
    for pattern in patterns:
        value = zdtype.from_json_scalar(f"0x{pattern:0{2 * size}x}", zarr_format=3)
        as_json = zdtype.to_json_scalar(value, zarr_format=3)
        back = zdtype.from_json_scalar(json.loads(json.dumps(as_json)), zarr_format=3)
        assert zdtype._bits(back) == pattern, (pattern, as_json)
    sample = patterns[:: max(1, len(patterns) // 12)] + [zdtype._bits(math.nan)]
    for i, pattern in enumerate(sample):
        fill = zdtype.from_json_scalar(f"0x{pattern:0{2 * size}x}", zarr_format=3)
        path = tmp_path / str(i)
        arr = zarr.create_array(path, shape=(5,), chunks=(2,), dtype=zdtype, fill_value=fill, zarr_format=3)
        arr[1:2] = np.ones(1, np.float32).astype(zdtype.to_native_dtype())
        got = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/"}}, read=True).result().read().result()
        assert bits_of(got)[[0, 2, 3, 4]].tolist() == [pattern] * 4, (name, pattern)


def test_int4_fill_values_are_integers_in_range():
    z = Int4()
    assert [int(z.from_json_scalar(v, zarr_format=3)) for v in (-8, -3, 0, 7)] == [-8, -3, 0, 7]
    assert [z.to_json_scalar(v, zarr_format=3) for v in (-8, np.int8(7), ml_dtypes.int4(-1), 3.0)] == [-8, 7, -1, 3]
    with pytest.raises(TypeError, match=r"Invalid fill value 8 for int4: expected an integer in \[-8, 7\]"):
        z.from_json_scalar(8, zarr_format=3)
    with pytest.raises(TypeError, match=r"expected an integer in \[-8, 7\]"):
        z.from_json_scalar(1.5, zarr_format=3)
    with pytest.raises(TypeError, match=r"expected an integer in \[-8, 7\]"):
        z.from_json_scalar("0x0f", zarr_format=3)


def test_e8m0_zero_is_its_smallest_value_and_is_written_as_bits():
    z = Float8E8M0FNU()
    assert z._bits(z.from_json_scalar(0, zarr_format=3)) == 0x00  # what tsckpt writes; ml_dtypes would say NaN
    assert z._bits(z.from_json_scalar(2.0, zarr_format=3)) == 0x80
    assert z.to_json_scalar(z.from_json_scalar(2.0, zarr_format=3), zarr_format=3) == "0x80"
    assert z.to_json_scalar(z.from_json_scalar("NaN", zarr_format=3), zarr_format=3) == "NaN"


def test_bad_fill_values_name_the_type_and_the_forms():
    bf = BY_NAME["bfloat16"]()
    with pytest.raises(TypeError, match=r"Invalid fill value '0x12345' for bfloat16: expected '0x' and the raw bits, at most 4 hex digits"):
        bf.from_json_scalar("0x12345", zarr_format=3)
    with pytest.raises(TypeError, match=r"Invalid fill value 'one' for bfloat16: expected a number, 'NaN'"):
        bf.from_json_scalar("one", zarr_format=3)
    with pytest.raises(TypeError, match="Invalid fill value True for bfloat16"):
        bf.from_json_scalar(True, zarr_format=3)


def test_non_canonical_nans_keep_their_bits_and_canonical_ones_are_named():
    bf = BY_NAME["bfloat16"]()
    assert bf.to_json_scalar(bf.from_json_scalar("0x7fe0", zarr_format=3), zarr_format=3) == "0x7fe0"
    assert bf.to_json_scalar(ml_dtypes.bfloat16(math.nan), zarr_format=3) == "NaN"
    assert bf.to_json_scalar(-0.0, zarr_format=3) == -0.0 and math.copysign(1, bf.to_json_scalar(-0.0, zarr_format=3)) < 0
    assert bf.to_json_scalar("Infinity", zarr_format=3) == "Infinity"


# ---- entry points and imports -------------------------------------------------------


def declared_entry_points() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(config["project"]["entry-points"]["zarr.data_type"])


def test_the_entry_points_name_every_class_under_its_zarr_name():
    declared = declared_entry_points()
    assert declared == {cls._zarr_v3_name: f"tsckpt_zarr.dtypes:{cls.__name__}" for cls in DATA_TYPES}
    for name, value in declared.items():
        cls = EntryPoint(name=name, value=value, group="zarr.data_type").load()
        assert cls is BY_NAME[name] and cls._zarr_v3_name == name


def entry_points_dir(tmp_path: Path) -> Path:
    """A directory that makes this checkout an installed distribution named tsckpt with
    the entry points pyproject.toml declares (put before site-packages on sys.path)."""
    info = tmp_path / "site" / "tsckpt-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tsckpt\nVersion: 0.0\n")
    lines = ["[zarr.data_type]", *(f"{k} = {v}" for k, v in declared_entry_points().items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return info.parent


# Opens a bfloat16 array with no code of tsckpt's; where zarr-python does not load the
# entry points (before 3.4), registers and opens it again. Prints what happened as JSON.
PROBE = textwrap.dedent("""
    import json, sys
    import zarr
    out = {"zarr": zarr.__version__}
    try:
        out["without_code"] = zarr.open_array(sys.argv[1], mode="r")[...].tobytes().hex()
    except ValueError as e:
        out["refused"] = str(e)
        import tsckpt_zarr
        tsckpt_zarr.register()
        out["after_register"] = zarr.open_array(sys.argv[1], mode="r")[...].tobytes().hex()
    out["imported"] = sorted(m for m in ("torch", "tensorstore", "tsckpt") if m in sys.modules)
    print(json.dumps(out))
""")


def probe(python: str, tmp_path: Path, array: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(entry_points_dir(tmp_path)), str(ROOT)])}
    done = subprocess.run([python, "-c", PROBE, array], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def zarr_version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def check_probe(python: str, tmp_path: Path, ckdir: str) -> str:
    """Runs PROBE with ``python`` on a saved bfloat16 array; returns that zarr-python's version."""
    t = torch.randn(3, 7).to(torch.bfloat16)
    tsckpt.save(ckdir, {"w": t})
    want = t.view(torch.int16).numpy().tobytes().hex()
    out = probe(python, tmp_path, os.path.join(ckdir, "w"))
    assert out["imported"] == [], out  # loading the data types imports no torch, TensorStore or tsckpt
    if zarr_version(out["zarr"]) >= (3, 4):
        assert out.get("without_code") == want, out
    else:  # zarr-python 3.1 to 3.3 collect the entry points but never load them
        assert "No Zarr data type found that matches 'bfloat16'" in out["refused"], out
        assert out["after_register"] == want, out
    return str(out["zarr"])


@pytest.mark.slow
def test_installed_entry_points_with_this_zarr_python(tmp_path, ckdir):
    assert check_probe(sys.executable, tmp_path, ckdir) == zarr.__version__


@pytest.mark.slow
def test_installed_entry_points_with_another_zarr_python(tmp_path, ckdir):
    """With the interpreter TSCKPT_TEST_ZARR_PYTHON names (CONTRIBUTING.md, "Test tiers")."""
    python = os.environ.get("TSCKPT_TEST_ZARR_PYTHON")
    if not python:
        pytest.skip("TSCKPT_TEST_ZARR_PYTHON is not set: no other zarr-python to check")
    check_probe(python, tmp_path, ckdir)


@pytest.mark.slow
def test_importing_tsckpt_imports_no_zarr():
    code = "import sys, tsckpt; print(sorted(m for m in ('zarr', 'tsckpt_zarr') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
