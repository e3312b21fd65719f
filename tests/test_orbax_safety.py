"""Hostile Orbax checkpoints: paths out of the item, links, chunks that decode to gigabytes,
JSON nested too deeply, keys that make no tree. Each is refused with a tsckpt error naming the
file and the field, before anything outside the checkpoint is read or anything is decoded."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ocp = pytest.importorskip("orbax.checkpoint")

import tsckpt  # noqa: E402
from tests.foreign import run_capped, zstd_zeros  # noqa: E402
from tsckpt._errors import CorruptCheckpointError, LinkRefusedError
from tsckpt._formats import orbax as _orbax


def _tree() -> dict:
    return {"a": np.arange(4, dtype=np.float32), "b": {"c": np.ones((2, 3), np.int32)}, "s": 3}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An item per layout: name -> directory."""
    base = tmp_path_factory.mktemp("orbax_safety")
    out = {}
    for ocdbt, zarr3 in ((False, False), (False, True), (True, True)):
        name = f"{'ocdbt' if ocdbt else 'files'}-{'zarr3' if zarr3 else 'zarr2'}"
        ocp.PyTreeCheckpointer(use_ocdbt=ocdbt, use_zarr3=zarr3).save(base / name, _tree())
        out[name] = str(base / name)
    return out


def _copy(saved, name, tmp_path) -> str:
    ck = str(tmp_path / "ck")
    shutil.copytree(saved[name], ck)
    return ck


def _set_key(ck: str, key: str) -> None:
    """Store leaf 'a' under the key ``key`` in the item's _METADATA."""
    path = os.path.join(ck, "_METADATA")
    meta = json.load(open(path))
    meta["tree_metadata"]["('a',)"]["key_metadata"][0]["key"] = key
    with open(path, "w") as f:
        json.dump(meta, f)


# ---- reads outside the checkpoint -------------------------------------------------------------


@pytest.mark.parametrize("name", ["files-zarr2", "ocdbt-zarr3"])
@pytest.mark.parametrize("outside", ["absolute", "../elsewhere", "a/../../elsewhere"])
def test_a_key_naming_a_place_outside_is_refused(saved, tmp_path, name, outside):
    """An absolute key opened that array and convert copied it; '..' gave a raw ValueError."""
    ck = _copy(saved, name, tmp_path)
    secret = tmp_path / "elsewhere"
    shutil.copytree(saved["files-zarr2"] + "/a", secret)
    key = str(secret) if outside == "absolute" else outside
    _set_key(ck, key)
    leaf = tsckpt.tree.escape(key)
    expected = (
        f"{ck}/_METADATA: leaf '{leaf}': the array name (its keys joined by '.') "
        f"{tsckpt._errors.short_repr(key)} is not a relative path inside the checkpoint; the checkpoint is damaged "
        "or made to read elsewhere: use a trusted copy"
    )
    for read in (lambda: tsckpt.open(ck), lambda: tsckpt.restore(ck), lambda: tsckpt.verify(ck),
                 lambda: tsckpt.convert(ck, str(tmp_path / "out"))):
        with pytest.raises(CorruptCheckpointError) as e:
            read()
        assert str(e.value) == expected
    assert not (tmp_path / "out").exists()


def test_a_linked_array_directory_is_refused(saved, tmp_path):
    ck = _copy(saved, "files-zarr2", tmp_path)
    shutil.copytree(os.path.join(ck, "a"), tmp_path / "elsewhere")
    shutil.rmtree(os.path.join(ck, "a"))
    os.symlink(tmp_path / "elsewhere", os.path.join(ck, "a"))
    for read in (lambda: tsckpt.open(ck), lambda: tsckpt.verify(ck), lambda: tsckpt.convert(ck, str(tmp_path / "o"))):
        with pytest.raises(LinkRefusedError) as e:
            read()
        assert str(e.value) == (
            f"{ck}: a is a symbolic link (to {tmp_path / 'elsewhere'}); tsckpt does not follow symbolic links in a "
            "checkpoint, which must hold its own files (a link could lead anywhere; docs/security.md): replace each "
            "link with a copy of its file"
        )
    assert not (tmp_path / "o").exists()


def test_a_linked_metadata_file_is_refused(saved, tmp_path):
    ck = _copy(saved, "files-zarr2", tmp_path)
    os.rename(os.path.join(ck, "_METADATA"), tmp_path / "meta")
    os.symlink(tmp_path / "meta", os.path.join(ck, "_METADATA"))
    with pytest.raises(LinkRefusedError, match=r": _METADATA is a symbolic link \(to "):
        tsckpt.open(ck)


def test_an_item_name_outside_the_step_is_refused(tmp_path):
    with ocp.CheckpointManager(tmp_path / "run", item_names=("state",)) as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(_tree())))
        mgr.wait_until_finished()
    step = tmp_path / "run" / "1"
    meta = json.load(open(step / "_CHECKPOINT_METADATA"))
    meta["item_handlers"] = {"../../elsewhere": meta["item_handlers"]["state"]}
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    with pytest.raises(CorruptCheckpointError) as e:
        tsckpt.open(str(step))
    assert str(e.value) == (
        f"{step}/_CHECKPOINT_METADATA: an item of 'item_handlers' '../../elsewhere' is not a relative path inside the "
        "checkpoint; the checkpoint is damaged or made to read elsewhere: use a trusted copy"
    )


# ---- decompression bombs and JSON TensorStore cannot parse ----------------------------------------


def _bomb(ck: str, chunk: int, shape: int) -> None:
    """Make leaf 'a' (zarr v2, zstd) an array of ``shape`` float32 whose one chunk of ``chunk``
    elements is stored in 128 KiB for 4 GiB."""
    node = os.path.join(ck, "a", ".zarray")
    meta = json.load(open(node))
    meta.update(chunks=[chunk], shape=[shape])
    with open(node, "w") as f:
        json.dump(meta, f)
    with open(os.path.join(ck, "a", "0"), "wb") as f:
        f.write(zstd_zeros(chunk * 4))


def _bomb_message(ck: str, shape: int, chunk: int) -> str:
    return (
        f"{ck}: leaf 'a': 'a/.zarray' gives the array [{shape}] chunks of [{chunk}] ({chunk * 4} bytes decoded "
        f"each): expected chunks no larger than the array, of at most {2 << 30} bytes (the largest "
        "orbax-checkpoint writes by default); refused before any is decoded: the checkpoint is damaged or made to "
        "exhaust memory, use a trusted copy"
    )


@pytest.mark.slow
@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("shape", [4, 2**30])
def test_a_chunk_that_decodes_to_gigabytes_is_refused_before_decoding(saved, tmp_path, shape):
    """A 128 KiB chunk decoding to 4 GiB aborted the process (std::bad_alloc) reading 4 elements.
    Run in a process whose address space is capped, so a regression cannot take this one down."""
    ck = _copy(saved, "files-zarr2", tmp_path)
    _bomb(ck, 2**30, shape)
    assert os.path.getsize(os.path.join(ck, "a", "0")) < 200 << 10
    r = run_capped(f"""
        try:
            tsckpt.open({ck!r})["a"][...]
        except tsckpt.CorruptCheckpointError as e:
            print(e)
        print(main(["verify", {ck!r}]))
        print(main(["convert", {ck!r}, {str(tmp_path / 'out')!r}]))
    """, warm=saved["files-zarr2"])
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    message = _bomb_message(ck, shape, 2**30)
    assert r.stdout.splitlines() == [message, "1", "1"], r.stdout
    assert r.stderr.splitlines() == [f"tsckpt verify: error: {message}", f"tsckpt convert: error: {message}"]
    assert not (tmp_path / "out").exists()


def test_a_chunk_larger_than_its_array_is_refused_even_when_small(saved, tmp_path):
    ck = _copy(saved, "files-zarr2", tmp_path)
    _bomb(ck, 1024, 4)
    with pytest.raises(CorruptCheckpointError) as e:
        tsckpt.open(ck)
    assert str(e.value) == _bomb_message(ck, 4, 1024)


def test_zarr3_shards_and_their_index_are_bounded(saved, tmp_path):
    ck = _copy(saved, "files-zarr3", tmp_path)
    node = os.path.join(ck, "a", "zarr.json")
    meta = json.load(open(node))
    meta["shape"] = [2**28]
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [2**28]
    meta["codecs"][0]["configuration"]["chunk_shape"] = [1]
    with open(node, "w") as f:
        json.dump(meta, f)
    with pytest.raises(CorruptCheckpointError) as e:
        tsckpt.open(ck)
    assert str(e.value).startswith(
        f"{ck}: leaf 'a': 'a/zarr.json' gives the array [{2**28}] chunks of [1] (4 bytes decoded each, "
        f"{2**28 * 16} bytes of shard index): expected chunks no larger than the array, of at most"
    )


@pytest.mark.slow
@pytest.mark.slow  # starts a process
def test_array_metadata_nested_too_deeply_is_refused_not_a_crash(saved, tmp_path):
    """TensorStore crashed (SIGSEGV) parsing a .zarray nested 100,000 deep."""
    ck = _copy(saved, "files-zarr2", tmp_path)
    node = os.path.join(ck, "a", ".zarray")
    text = open(node).read().rstrip()
    with open(node, "w") as f:
        f.write(text[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    r = run_capped(f"print(main(['verify', {ck!r}]))", warm=saved["files-zarr2"])
    assert r.returncode == 0 and r.stdout.strip() == "1", (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip() == (
        f"tsckpt verify: error: {ck}: leaf 'a': 'a/.zarray' is not JSON (nested too deeply to parse), expected a JSON "
        "object; the checkpoint is damaged, re-save it"
    )


@pytest.mark.parametrize("file", ["_METADATA", "_CHECKPOINT_METADATA"])
def test_item_metadata_nested_too_deeply_is_corrupt(saved, tmp_path, file):
    """A RecursionError before."""
    ck = _copy(saved, "files-zarr2", tmp_path)
    os.remove(os.path.join(ck, "commit_success.txt"))  # so that the commit is read from _CHECKPOINT_METADATA
    with open(os.path.join(ck, file), "w") as f:
        f.write('{"tree_metadata": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CorruptCheckpointError) as e:
        tsckpt.open(ck)
    assert str(e.value).startswith(
        f"{ck}: Orbax metadata file '{file}' is unreadable: expected JSON, found nested too deeply to parse;"
    )


# ---- keys that make no tree ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda m: m["('a',)"]["key_metadata"][0].update(key_type=1),
         "'key_metadata' has the sequence index 'a', expected a number"),
        (lambda m: m["('a',)"]["key_metadata"].extend([{"key": "k", "key_type": 2}] * 201),
         "'key_metadata' nests 202 levels deep, more than 200"),
        (lambda m: m["('a',)"].update(key_metadata=5), "is malformed: expected 'key_metadata' and 'value_metadata'"),
    ],
)
def test_malformed_keys_are_named(saved, tmp_path, edit, why):
    ck = _copy(saved, "files-zarr2", tmp_path)
    path = os.path.join(ck, "_METADATA")
    meta = json.load(open(path))
    edit(meta["tree_metadata"])
    with open(path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(CorruptCheckpointError, match=rf"^{re.escape(ck)}: Orbax '_METADATA' entry .*{re.escape(why)}"):
        tsckpt.open(ck)


def test_two_entries_of_one_leaf_are_refused(saved, tmp_path):
    ck = _copy(saved, "files-zarr2", tmp_path)
    path = os.path.join(ck, "_METADATA")
    meta = json.load(open(path))
    meta["tree_metadata"]["('b', 'c')"]["key_metadata"] = [{"key": "a", "key_type": 2}]
    with open(path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(CorruptCheckpointError) as e:
        tsckpt.open(ck)
    assert str(e.value) == (
        f"{ck}: Orbax '_METADATA' gives leaf paths that make no tree: it lists the leaf 'a' twice; the checkpoint "
        "is damaged, re-save it"
    )


def test_a_json_item_nested_too_deeply_is_corrupt(tmp_path):
    with ocp.CheckpointManager(tmp_path / "run", item_names=("meta",)) as mgr:
        mgr.save(1, args=ocp.args.Composite(meta=ocp.args.JsonSave({"a": 1})))
        mgr.wait_until_finished()
    item = tmp_path / "run" / "1" / "meta"
    (item / "metadata").write_text('{"k": ' + "[" * 300 + "1" + "]" * 300 + "}")
    with pytest.raises(CorruptCheckpointError) as e:
        tsckpt.open(str(tmp_path / "run" / "1"))
    assert str(e.value) == (
        f"{item}/metadata: the JSON item nests more than 200 levels deep; the checkpoint is damaged, re-save it"
    )
    (item / "metadata").write_text('{"k": ' + "[" * 150 + "1" + "]" * 150 + "}")
    assert tsckpt.open(str(tmp_path / "run" / "1"))["meta/k" + "/0" * 150] == 1


# ---- verify says what it could check ------------------------------------------------------------


def test_verify_claims_no_checksum_orbax_does_not_store(saved, tmp_path, capsys):
    """A flipped byte in an Orbax chunk that still decodes: verify reads every chunk but has no
    checksum to catch it, and says so instead of "all checksums match"."""
    from tsckpt._cli import main

    ck = _copy(saved, "files-zarr2", tmp_path)
    chunk = os.path.join(ck, "a", "0")
    data = bytearray(open(chunk, "rb").read())
    data[-1] ^= 1  # zstd without a content checksum: the last byte of the last value
    open(chunk, "wb").write(bytes(data))
    report = tsckpt.verify(ck)
    assert report.ok and report.format == "orbax" and report.checksums is False
    assert (report.n_arrays, report.files_read, report.bytes_read) == (2, 2, 16 + 24)
    assert tsckpt.restore(ck)["a"].tolist() != _tree()["a"].tolist()  # the damage verify cannot see
    assert main(["verify", ck]) == 0
    assert capsys.readouterr().out == (
        f"OK: {ck}: orbax checkpoint, committed, all 3 leaves present; 2 arrays read (40 B in 2 chunk reads), no "
        "checksums in this format: damage that still decodes is not detected; 1 value\n"
    )
    own = str(tmp_path / "own")
    tsckpt.save(own, _tree())
    assert tsckpt.verify(own).checksums is True and tsckpt.verify(own).format == "tsckpt"
    assert main(["verify", own]) == 0
    assert "all checksums match" in capsys.readouterr().out


# ---- arrays that claim more than they store -----------------------------------------------------


def _reshape(ck: str, shape: int, chunk: int) -> None:
    node = os.path.join(ck, "a", ".zarray")
    meta = json.load(open(node))
    meta.update(shape=[shape], chunks=[chunk])
    with open(node, "w") as f:
        json.dump(meta, f)


def test_a_large_array_must_store_every_chunk(saved, tmp_path, monkeypatch):
    """A node of kilobytes claimed 128 MiB in 2**23 chunks with one stored: restore allocated
    it all before reading. Missing chunks are errors in what Orbax writes, so every chunk of
    a read above 64 MiB must be there."""
    ck = _copy(saved, "files-zarr2", tmp_path)
    _reshape(ck, 2**25, 4)
    for read in (lambda: tsckpt.open(ck), lambda: tsckpt.restore(ck), lambda: tsckpt.convert(ck, str(tmp_path / "o"))):
        with pytest.raises(CorruptCheckpointError) as e:
            read()
        assert str(e.value) == (
            f"{ck}: leaf 'a': 'a/.zarray' gives the array [{2**25}] {2**23} chunks of [4] but it stores 1, and a "
            "missing chunk is an error in this checkpoint; refused before anything is allocated: the checkpoint is "
            "damaged, re-save it"
        )
    assert not (tmp_path / "o").exists()


def test_an_array_of_too_many_chunks_is_refused(saved, tmp_path):
    ck = _copy(saved, "files-zarr2", tmp_path)
    _reshape(ck, 2**25, 1)
    with pytest.raises(CorruptCheckpointError) as e:
        tsckpt.open(ck)
    assert str(e.value) == (
        f"{ck}: leaf 'a': 'a/.zarray' gives the array [{2**25}] {2**25} chunks of [1]: expected at most {2**24}; the "
        "checkpoint is damaged or made to exhaust memory, use a trusted copy"
    )
