"""A model in the Hugging Face hub cache (``models--ORG--NAME/snapshots/REV/``, each file a link
into ``../../blobs/``) is read by every verb, and ``hf://ORG/NAME[@REV]`` finds it there; any
other link is refused as before (docs/security.md)."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import tsckpt
from tsckpt._storage import hfcache, native

REV = "0123456789abcdef0123456789abcdef01234567"
REV2 = "89abcdef0123456789abcdef0123456789abcdef"
CONFIG = b'{"model_type": "tiny", "torch_dtype": "bfloat16"}\n'


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No network, and the hub cache in tmp_path (huggingface_hub reads HF_HUB_CACHE at import)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def _st_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def _blob_name(name: str, data: bytes) -> str:
    """huggingface_hub names a blob by its etag: an LFS file's sha256, a git file's blob sha1."""
    if name.endswith((".safetensors", ".bin")):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_repo(cache, files: dict[str, bytes], repo: str = "org/tiny", rev: str = REV, ref: str | None = "main",
               kind: str = "model") -> str:
    """A download laid out as huggingface_hub's cache lays it out: blobs/<etag>, refs/<ref>
    holding the commit, snapshots/<commit>/<file> a relative link to its blob. The snapshot's path."""
    top = cache / f"{kind}s--{repo.replace('/', '--')}"
    snap = top / "snapshots" / rev
    (top / "blobs").mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = top / "blobs" / _blob_name(name, data)
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)  # as huggingface_hub's _create_symlink does
    if ref is not None:
        (top / "refs").mkdir(exist_ok=True)
        (top / "refs" / ref).write_text(rev)
    return str(snap)


def single(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    tensors = {
        "embed.weight": torch.randn(7, 5).to(torch.bfloat16), "norm.weight": torch.randn(5).to(torch.bfloat16),
        "step": torch.arange(4, dtype=torch.int64),
    }
    return cache_repo(tmp_path / "hub", {"model.safetensors": _st_bytes(tensors), "config.json": CONFIG}), tensors


def sharded(tmp_path) -> str:
    one = {"a.weight": torch.randn(3, 4).to(torch.bfloat16), "a.bias": torch.randn(4).to(torch.bfloat16)}
    two = {"b.weight": torch.randn(2, 2, 2).to(torch.bfloat16), "b.count": torch.arange(5)}
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    index = {"metadata": {"total_size": 0}, "weight_map": {**dict.fromkeys(one, names[0]), **dict.fromkeys(two, names[1])}}
    return cache_repo(tmp_path / "hub", {
        names[0]: _st_bytes(one), names[1]: _st_bytes(two), "model.safetensors.index.json": json.dumps(index).encode(),
        "config.json": CONFIG,
    })


def expected(snap: str) -> dict[str, torch.Tensor]:
    """What safetensors' own loader reads from the snapshot (following its links)."""
    index = os.path.join(snap, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(snap, "model.safetensors"))
    with open(index, "rb") as f:
        files = set(json.load(f)["weight_map"].values())
    return {k: v for f in sorted(files) for k, v in load_file(os.path.join(snap, f)).items()}


def assert_same(got: dict, want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        g = got[name]
        g = g if isinstance(g, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(np.asarray(g)).view(np.uint8))
        assert g.dtype in (t.dtype, torch.uint8)
        want_bytes = t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        assert torch.equal(g.contiguous().reshape(-1).view(torch.uint8), want_bytes.reshape(-1)), name


def test_the_layout_is_huggingface_hubs_own(tmp_path):
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    snap = sharded(tmp_path)
    cache = str(tmp_path / "hub")
    assert try_to_load_from_cache("org/tiny", "config.json", cache_dir=cache) == os.path.join(snap, "config.json")
    info = scan_cache_dir(cache)
    assert not info.warnings and [r.repo_id for r in info.repos] == ["org/tiny"]
    assert [r.commit_hash for r in next(iter(info.repos)).revisions] == [REV]
    assert hfcache.snapshot(snap) == hfcache.Snapshot(os.path.dirname(os.path.dirname(snap)), "model", "org/tiny", REV)


@pytest.mark.parametrize("make", [single, sharded])
def test_every_verb_reads_a_cached_snapshot_bit_exact(tmp_path, make):
    made = make(tmp_path)
    snap = made[0] if isinstance(made, tuple) else made
    want = expected(snap)
    # restore: into a target of the stored dtypes, and with none
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    assert_same(tsckpt.restore(snap, target), want)
    assert_same(tsckpt.restore(snap), want)
    # open and metadata
    ck = tsckpt.open(snap)
    assert_same({k: ck[k][...] for k in want}, want)
    meta = tsckpt.metadata(snap)
    assert {k: tuple(m.shape) for k, m in meta.items()} == {k: tuple(v.shape) for k, v in want.items()}
    # verify reads every byte
    report = tsckpt.verify(snap, progress=False)
    assert report.ok if hasattr(report, "ok") else not report.bad
    assert report.bytes_read == sum(v.numel() * v.element_size() for v in want.values())
    # convert: to tsckpt and to a Hugging Face directory (config copied from the snapshot too)
    tsckpt.convert(snap, str(tmp_path / "ts"))
    assert_same(tsckpt.restore(str(tmp_path / "ts"), target), want)
    tsckpt.convert(snap, str(tmp_path / "hf"), to_format="safetensors", copy_from=snap)
    assert_same(expected(str(tmp_path / "hf")), want)
    assert (tmp_path / "hf" / "config.json").read_bytes() == CONFIG
    assert not (tmp_path / "hf" / "config.json").is_symlink()


def test_the_command_line_reads_a_cached_snapshot(tmp_path, capsys):
    from tsckpt._cli import main

    snap, _ = single(tmp_path)
    assert main(["verify", snap]) == 0
    assert main(["ls", "hf://org/tiny"]) == 0
    assert "embed.weight" in capsys.readouterr().out
    assert main(["convert", "hf://org/tiny", str(tmp_path / "out")]) == 0


def test_a_torch_save_download_is_read_too(tmp_path):
    tensors = {"w": torch.randn(3, 3), "b": torch.arange(3)}
    path = tmp_path / "made.bin"
    torch.save(tensors, path)
    snap = cache_repo(tmp_path / "hub", {"pytorch_model.bin": path.read_bytes()})
    assert_same(tsckpt.restore(snap, {k: torch.zeros_like(v) for k, v in tensors.items()}), tensors)
    assert not tsckpt.verify(snap, progress=False).bad
    # sharded, through pytorch_model.bin.index.json
    torch.save({"w": tensors["w"]}, tmp_path / "one.bin")
    torch.save({"b": tensors["b"]}, tmp_path / "two.bin")
    index = {"metadata": {}, "weight_map": {"w": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}}
    snap = cache_repo(tmp_path / "hub", {
        "pytorch_model-00001-of-00002.bin": (tmp_path / "one.bin").read_bytes(),
        "pytorch_model-00002-of-00002.bin": (tmp_path / "two.bin").read_bytes(),
        "pytorch_model.bin.index.json": json.dumps(index).encode(),
    }, repo="org/sharded")
    assert_same(tsckpt.restore("hf://org/sharded", {k: torch.zeros_like(v) for k, v in tensors.items()}), tensors)


def test_hf_urls_read_the_local_cache(tmp_path):
    _, tensors = single(tmp_path)
    later = {"embed.weight": torch.ones(7, 5)}
    cache_repo(tmp_path / "hub", {"model.safetensors": _st_bytes(later)}, rev=REV2, ref="v2")
    target = {k: torch.zeros_like(v) for k, v in tensors.items()}
    assert_same(tsckpt.restore("hf://org/tiny", target), tensors)  # refs/main
    assert_same(tsckpt.restore(f"hf://org/tiny@{REV}", target), tensors)  # a commit
    assert_same(tsckpt.restore("hf://org/tiny@v2", {"embed.weight": torch.zeros(7, 5)}), later)  # a tag
    assert_same(tsckpt.restore(f"hf://org/tiny@{REV2}"), later)
    assert list(tsckpt.metadata("hf://org/tiny")) == sorted(tensors)
    assert not tsckpt.verify("hf://org/tiny", progress=False).bad
    tsckpt.convert("hf://org/tiny@v2", str(tmp_path / "out"), to_format="safetensors", copy_from="hf://org/tiny")
    assert_same(load_file(str(tmp_path / "out" / "model.safetensors")), later)
    # a model id without an organisation
    cache_repo(tmp_path / "hub", {"model.safetensors": _st_bytes(later)}, repo="gpt0")
    assert_same(tsckpt.restore("hf://gpt0"), later)


def test_an_uncached_repo_names_it_and_how_to_download_it(tmp_path):
    single(tmp_path)
    cache = tmp_path / "hub"
    for url, repo, download in [
        ("hf://org/nope", "org/nope", "hf download org/nope`"),
        ("hf://org/nope@v1", "org/nope", "hf download org/nope --revision v1`"),
        ("hf://org/tiny@v9", "org/tiny", "hf download org/tiny --revision v9`"),
        (f"hf://org/tiny@{REV2}", "org/tiny", f"hf download org/tiny --revision {REV2}`"),
    ]:
        for read in (tsckpt.open, tsckpt.restore, tsckpt.metadata, tsckpt.verify,
                     lambda u: tsckpt.convert(u, str(tmp_path / "out"))):
            with pytest.raises(tsckpt.CheckpointNotFoundError) as info:
                read(url)
            assert isinstance(info.value, FileNotFoundError)
            msg = str(info.value)
            assert msg.startswith(f"{url}: the model {repo!r}") and f"({cache})" in msg and download in msg, msg
            assert "downloads nothing" in msg
    assert not os.path.exists(tmp_path / "out")
    for bad in ("hf://", "hf://a/b/c", "hf://org/../x", "hf://org/tiny@../../x"):
        with pytest.raises(ValueError, match="hf://"):
            tsckpt.restore(bad)


def test_saving_to_an_hf_url_is_refused(tmp_path):
    single(tmp_path)
    with pytest.raises(ValueError, match="only reads"):
        tsckpt.save("hf://org/tiny", {"w": torch.ones(2)})
    snap, _ = single(tmp_path / "x")
    with pytest.raises(ValueError, match="only reads"):
        tsckpt.convert(snap, "hf://org/tiny", to_format="safetensors")


# ---- anything else is refused as a link -----------------------------------------------------

LINK_WHY = (
    "tsckpt does not follow symbolic links in a checkpoint, which must hold its own files (a link could lead "
    "anywhere; docs/security.md)"
)


def _relink(snap: str, name: str, target: str) -> None:
    os.remove(os.path.join(snap, name))
    os.symlink(target, os.path.join(snap, name))


def _hostile(tmp_path, how: str) -> tuple[str, str]:
    """A cached snapshot whose model.safetensors is made hostile ``how``; (snapshot, link target)."""
    snap, _ = single(tmp_path)
    repo = os.path.dirname(os.path.dirname(snap))
    link = os.path.join(snap, "model.safetensors")
    blob_name = os.path.basename(os.readlink(link))
    blob = os.path.join(repo, "blobs", blob_name)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(_st_bytes({"secret": torch.ones(2)}))
    other = os.path.dirname(cache_repo(tmp_path / "hub", {"model.safetensors": outside.read_bytes()}, repo="org/other"))
    other_blob = os.path.basename(os.readlink(os.path.join(other, REV, "model.safetensors")))
    if how == "absolute":
        _relink(snap, "model.safetensors", "/etc/passwd")
    elif how == "absolute_own_blob":
        _relink(snap, "model.safetensors", blob)
    elif how == "other_repo":
        _relink(snap, "model.safetensors", f"../../../models--org--other/blobs/{other_blob}")
    elif how == "dotdot":
        _relink(snap, "model.safetensors", f"../../blobs/../../models--org--other/blobs/{other_blob}")
    elif how == "too_deep":  # <cache>/blobs/<hash>: above the repository
        os.makedirs(tmp_path / "hub" / "blobs")
        (tmp_path / "hub" / "blobs" / blob_name).write_bytes(outside.read_bytes())
        _relink(snap, "model.safetensors", f"../../../blobs/{blob_name}")
    elif how == "not_a_hash":
        os.rename(blob, os.path.join(repo, "blobs", "model"))
        _relink(snap, "model.safetensors", "../../blobs/model")
    elif how in ("blob_is_link", "blobs_dir_is_link"):
        if how == "blob_is_link":
            os.remove(blob)
            os.symlink(str(outside), blob)
        else:
            moved = tmp_path / "elsewhere"
            os.rename(os.path.join(repo, "blobs"), moved)
            os.symlink(moved, os.path.join(repo, "blobs"))
        return snap, os.readlink(link)
    elif how == "not_a_snapshot":  # a revision that is no commit: not huggingface_hub's layout
        moved = os.path.join(os.path.dirname(snap), "main")
        os.rename(snap, moved)
        snap = moved
    else:
        raise AssertionError(how)
    return snap, os.readlink(os.path.join(snap, "model.safetensors"))


HOSTILE = ["absolute", "absolute_own_blob", "other_repo", "dotdot", "too_deep", "not_a_hash", "blob_is_link",
           "blobs_dir_is_link", "not_a_snapshot"]


def _readers(tmp_path):
    return (tsckpt.open, tsckpt.restore, tsckpt.metadata, lambda s: tsckpt.verify(s, progress=False),
            lambda s: tsckpt.convert(s, str(tmp_path / "out")))


@pytest.mark.parametrize("how", HOSTILE)
def test_any_other_link_is_refused(tmp_path, how):
    snap, target = _hostile(tmp_path, how)
    for read in _readers(tmp_path):
        with pytest.raises(tsckpt.LinkRefusedError) as info:
            read(snap)
        msg = str(info.value)
        assert "secret" not in msg
        if how in ("blob_is_link", "blobs_dir_is_link"):  # the snapshot's link is right; its blob is not
            assert msg.startswith(f"{os.path.join(snap, 'model.safetensors')}: links to ")
            assert "which is a symbolic link or lies below one" in msg
        else:  # today's message, word for word
            assert msg.startswith(
                f"{snap}: the weights file 'model.safetensors': model.safetensors is a symbolic link (to {target}); "
                f"{LINK_WHY}: "
            ), msg
            assert info.value.link == os.path.join(snap, "model.safetensors") and info.value.target == target
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("how", ["other_repo", "blob_is_link", "blobs_dir_is_link"])
def test_hostile_links_are_refused_without_openat2(tmp_path, monkeypatch, how):
    monkeypatch.setattr(native, "has_openat2", lambda: False)
    snap, _ = _hostile(tmp_path, how)
    with pytest.raises(tsckpt.LinkRefusedError):
        tsckpt.restore(snap)
    good, tensors = single(tmp_path / "good")
    assert_same(tsckpt.restore(good), tensors)


def test_a_special_file_as_blob_is_refused(tmp_path):
    snap = sharded(tmp_path)
    blob = os.path.realpath(os.path.join(snap, "model-00002-of-00002.safetensors"))
    os.remove(blob)
    os.mkfifo(blob)
    with pytest.raises(tsckpt.CorruptCheckpointError, match="not a regular file"):
        tsckpt.restore(snap)


def test_a_link_changed_after_opening_cannot_redirect_the_read(tmp_path):
    snap, tensors = single(tmp_path)
    link = os.path.join(snap, "model.safetensors")
    blob = os.path.realpath(link)
    ck = tsckpt.open(snap)
    outside = tmp_path / "outside.safetensors"
    save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, str(outside))
    _relink(snap, "model.safetensors", str(outside))  # reads go to the blob, never through the link
    assert_same({k: ck[k][...] for k in tensors}, tensors)
    os.remove(blob)  # the blob itself replaced by a link: refused
    os.symlink(str(outside), blob)
    with pytest.raises(tsckpt.LinkRefusedError, match="which is a symbolic link"):
        ck["embed.weight"][...]


def test_a_nested_file_is_read_but_a_subfolder_or_a_directory_link_is_refused(tmp_path):
    index = {"metadata": {}, "weight_map": {"w": "sub/model.safetensors"}}
    snap = cache_repo(tmp_path / "hub", {
        "sub/model.safetensors": _st_bytes({"w": torch.arange(3.0)}),
        "model.safetensors.index.json": json.dumps(index).encode(),
    })
    assert os.readlink(os.path.join(snap, "sub", "model.safetensors")).startswith("../../../blobs/")
    assert_same(tsckpt.restore(snap, {"w": torch.zeros(3)}), {"w": torch.arange(3.0)})
    with pytest.raises(tsckpt.LinkRefusedError):  # the directory read is not the snapshot itself
        tsckpt.restore(os.path.join(snap, "sub"))
    # a directory on the way that is a link (to a directory of good links) is refused
    os.rename(os.path.join(snap, "sub"), os.path.join(snap, "real"))
    os.symlink("real", os.path.join(snap, "sub"))
    with pytest.raises(tsckpt.LinkRefusedError, match="'sub/model.safetensors': sub is a symbolic link"):
        tsckpt.restore(snap)


def test_a_missing_blob_is_an_incomplete_download(tmp_path):
    snap = sharded(tmp_path)
    os.remove(os.path.realpath(os.path.join(snap, "model-00002-of-00002.safetensors")))
    for read in _readers(tmp_path):
        with pytest.raises(tsckpt.CorruptCheckpointError, match="which is missing \\(the download is incomplete\\)"):
            read(snap)
