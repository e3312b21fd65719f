"""verify(): check every zarr.json node and read every chunk of a checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._base import dtypes as _dtypes
from .._base.types import box_slices
from .._codec import contenthash
from .._codec.files import stored_shapes
from .._formats import lazy
from .._formats.sources import open_checkpoint
from .._ondisk.arrays import chunk_file_bytes, chunk_key, chunk_size_problem, stored_node_problem
from .._ondisk.backing import backing_problems
from .._ondisk.checkpoint import TSCKPT, Checkpoint
from .._ondisk.chunking import shard_boxes
from .._ondisk.readfaults import describe_read_error
from .._ondisk.records import ROOT_KEY, ArrayRecord, content_chunks, content_entries
from .._options import RestoreOptions, verb
from .._runtime.progress import Progress
from .._runtime.window import Window
from .._storage.confine import odd_files, odd_problem, owner
from .._storage.faults import UNDECODABLE, storage_errors, storage_problem
from .._storage.locations import Directory

# Bytes of reads kept in flight.
VERIFY_WINDOW_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found. ``bad`` maps each bad leaf to why: its entry in the root
    metadata, its array node, or its stored bytes."""

    location: str
    leaves: tuple[str, ...]
    n_arrays: int
    n_values: int
    bad: Mapping[str, str]
    group_problems: tuple[str, ...]
    bytes_read: int
    files_read: int
    tree_problem: str | None = None  # the structure in the root metadata cannot rebuild the tree
    arrays: tuple[str, ...] = ()  # paths of the array records, valid or not
    format: str = TSCKPT  # the library that wrote the checkpoint
    # whether every chunk read was checked against a checksum stored with it: True for tsckpt's
    # own format; False where the format stores none (Orbax), so that damage which still
    # decodes reads back as other values and only unreadable data is found
    checksums: bool = True
    # the entries of ``bad`` (array paths, or files no array owns) not read only because a file of
    # theirs is a symbolic link (which tsckpt does not follow) or a special file: a problem of the
    # checkpoint, not damage of its data
    unread: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.bad and not self.group_problems and self.tree_problem is None


@dataclasses.dataclass(frozen=True)
class _Nodes:
    bad: dict[str, str]  # array path -> why its zarr.json is wrong
    group_problems: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Reads:
    bad: dict[str, str]  # array path -> why a chunk read failed
    bytes_read: int
    files_read: int


def _check_nodes(ck: Checkpoint, linked: Mapping[str, str]) -> _Nodes:
    """zarr.json of every array and group below the root, but for those on the way to which
    ``linked`` (:func:`_links`) names a link or special file: they are not read."""
    kv = ck.kvstore()
    groups = sorted({"/".join(p.split("/")[:i]) for p in ck.arrays for i in range(1, len(p.split("/")))})
    futures = {p: ck.read_node(p) for p in ck.arrays if not _meets(p, linked)}  # a huge one is not read
    group_futures = {g: ck.read_node(g) for g in groups if not _meets(g, linked)}
    bad: dict[str, str] = {}
    for p, fut in futures.items():
        problem = ck.node_file_problem(p)
        if problem is not None:
            bad[p] = f"its zarr.json {problem} (not read)"
            continue
        try:
            r = fut.result()
        except Exception as e:  # noqa: BLE001 - a damaged database: reported per leaf
            bad[p] = f"its zarr.json cannot be read ({' '.join(str(e).split())})"
            continue
        if r.state != "value":
            bad[p] = "its zarr.json is missing (zarr readers cannot open this array)"
            continue
        why = stored_node_problem(r.value, ck.arrays[p])
        if why:
            bad[p] = why
    problems = []
    for g, fut in group_futures.items():
        problem = ck.node_file_problem(g)
        if problem is not None:
            problems.append(f"group '{g}': zarr.json {problem} (not read)")
            continue
        try:
            r = fut.result()
            ok = r.state == "value" and json.loads(r.value).get("node_type") == "group"
        except (ValueError, AttributeError, RecursionError):  # TensorStore's read errors are ValueErrors too
            ok = False
        if not ok:
            problems.append(f"group '{g}': zarr.json is missing or not a zarr group node")
    return _Nodes(bad, tuple(problems))


def _check_chunks(rec: ArrayRecord, key: str, data: Any, recorded: Sequence[str], bad: dict[str, str]) -> None:
    """Report in ``bad`` a shard file ``key`` (its data read, ``data``) whose inner chunks' data do
    not hash to the hashes its root records for them; a list of another length than the
    file's inner chunks is read as none recorded (diff ignores it too)."""
    inner = stored_shapes(rec).inner
    if inner is None:
        return
    got = contenthash.chunk_digests(data, inner)
    wrong = [i for i, (x, y) in enumerate(zip(got, recorded)) if x != y] if len(got) == len(recorded) else []
    if wrong:
        bad.setdefault(
            rec.path, f"its file {key} does not hold the data its save hashed (inner chunk {wrong[0]} in C order: "
            f"content hash {recorded[wrong[0]]} recorded, {got[wrong[0]]} read)",
        )


def _read_all(ck: Checkpoint, skip: Mapping[str, str], progress: Progress) -> _Reads:
    """Read every shard file of every array not in ``skip``, a bounded window at a time; a
    file whose content hash the root records (docs/format.md, "Content hashes") is hashed
    and compared with it. Each unsharded chunk file is checked to be of the size its record
    gives it, whichever codec reads (TensorStore reads a file with bytes after its crc32c,
    which zarr readers refuse): on a local plain checkpoint from the size it had when opened
    (:meth:`Checkpoint.chunk_size_problem`, at the array's open), elsewhere by a 1-byte read
    just past that size (:func:`_longer`)."""
    bad: dict[str, str] = {}
    hashes = content_entries(ck.raw) if not ck.foreign else {}
    chunks = content_chunks(ck.raw) if not ck.foreign else {}

    def settle(read: tuple[Any, str, int, str, Any]) -> None:
        fut, path, nbytes, key, past = read
        progress.update(nbytes, 1)
        if past is not None and path not in bad and _longer(ck, past):
            bad[path] = f"{UNDECODABLE} ({chunk_size_problem(ck.arrays[path], key, None)})"
        try:
            data = fut.result()
        except Exception as e:  # noqa: BLE001 - every failure is reported per leaf
            unreachable = storage_problem(ck.location, e)
            if unreachable is not None:  # not damage: the storage itself failed
                raise unreachable from e
            bad.setdefault(path, describe_read_error(e))
            return
        if key in hashes and contenthash.digest(data) != hashes[key][0]:
            bad.setdefault(
                path, f"its file {key} does not hold the data its save hashed (content hash {hashes[key][0]} "
                f"recorded, {contenthash.digest(data)} read)",
            )
        elif key in chunks:
            _check_chunks(ck.arrays[path], key, data, chunks[key], bad)

    window: Window[tuple[Any, str, int, str, Any]] = Window(VERIFY_WINDOW_BYTES, settle)
    total = files = 0
    # the shards' sizes, before TensorStore decodes any
    bad.update(backing_problems(ck, [(p, None) for p in ck.arrays if p not in skip]))
    for path, rec in ck.arrays.items():
        if path in skip or path in bad:  # its zarr.json is missing or wrong: no reader can open it
            continue
        if ck.lazy:
            total, files = total + _read_source(ck, path, bad, progress), files + 1
            continue
        store = _open(ck, path, bad)
        if store is None:
            continue
        # where no held descriptor gave its size (another format's files are that format's own)
        probe = rec.chunking.chunk_shape is None and not ck.held_sizes and not ck.foreign
        size = chunk_file_bytes(rec)
        for off, ln in shard_boxes((0,) * len(rec.shape), rec.shape, rec.chunking):
            if path in bad:
                break
            view = store[box_slices(off, ln)] if off else store
            nbytes = math.prod(ln) * _dtypes.itemsize(rec.dtype)
            key = chunk_key(rec, off)
            past = ck.kvstore().read(key, byte_range=slice(size, size + 1)) if probe else None
            window.add((view.read(), path, nbytes, key, past), nbytes)
            total, files = total + nbytes, files + 1
    window.drain()
    return _Reads(bad, total, files)


def _longer(ck: Checkpoint, past: Any) -> bool:
    """Whether the read ``past`` of the byte just past a chunk file's size found one: the file
    is longer than its record gives it. A shorter or missing file, or a failed read, is left
    to the read of its data, which says why."""
    try:
        found = past.result()
    except ValueError as e:
        unreachable = storage_problem(ck.location, e)
        if unreachable is not None:
            raise unreachable from e
        return False  # OUT_OF_RANGE: the file ends where its record says (or sooner)
    return found.state == "value" and len(found.value) > 0


def _read_source(ck: Checkpoint, path: str, bad: dict[str, str], progress: Progress) -> int:
    """Read another format's array ``path`` block by block from its files; bytes read. A read
    that fails goes to ``bad`` (such formats store no checksums: only what cannot be read is found)."""
    rec = ck.arrays[path]
    src = (ck.sources or {})[path]
    nbytes = 0
    for off, ln in shard_boxes((0,) * len(rec.shape), rec.shape, rec.chunking):
        n = math.prod(ln) * _dtypes.itemsize(rec.dtype)
        try:
            lazy.read(src, box_slices(off, ln))
        except (ValueError, OSError, RuntimeError) as e:  # tsckpt's read errors have these bases
            bad[path] = f"cannot be read ({' '.join(str(e).split())})"
            break
        progress.update(n, 1)
        nbytes += n
    return nbytes


def _open(ck: Checkpoint, path: str, bad: dict[str, str]) -> Any:
    """The opened array ``path``, or None with why it cannot be opened in ``bad``."""
    try:
        return ck.open_array_future(path).result()
    except Exception as e:  # noqa: BLE001
        unreachable = storage_problem(ck.location, e)
        if unreachable is not None:
            raise unreachable from e
        why = ck.chunk_size_problem(path)  # the open's refusal of a chunk file of another size, in verify's words
        bad[path] = f"{UNDECODABLE} ({why})" if why is not None else f"cannot open the array ({' '.join(str(e).split())})"
        return None


def _meets(path: str, linked: Mapping[str, str]) -> bool:
    """Whether reading the node or data of the array or group ``path`` would meet an entry
    ``linked`` names: an array path (its files), or the relative path of a link or special
    file no array owns (a directory on the way, or a group's own node)."""
    return any(k == path or path.startswith(f"{k}/") or k == f"{path}/{ROOT_KEY}" for k in linked)


def _links(ck: Checkpoint) -> dict[str, str]:
    """Local checkpoints: array path -> why one of its files is a symbolic link or a special
    file (readers refuse such a checkpoint; verify lists every one, and reads none of those
    arrays: a link could lead anywhere, and a FIFO would never answer)."""
    if ck.location.local is None or ck.foreign:
        return {}
    found: dict[str, str] = {}
    for rel, odd in odd_files(ck.location.local).items():
        found.setdefault(owner(rel, tuple(ck.arrays)) or rel, "; ".join(odd_problem(rel, odd, ck.location.local)))
    return found


@verb("tsckpt.verify")
def verify(
    directory: Directory,
    *,
    progress: bool | None = None,
    format: str | None = None,  # noqa: A002 - as for restore
    allow_pickle: bool = False,
) -> VerifyReport:
    """Check a committed checkpoint: every array and group ``zarr.json`` against the root
    metadata, every chunk read back with its checksum (and the content hash of each file
    whose save recorded one, which no crc32c forgery passes), and (on a local disk) no file a
    symbolic link. Another library's checkpoint (Orbax) is checked as far as its format
    allows: its metadata is parsed and checked and every chunk is read and decoded, but its
    chunks carry no checksum (``report.checksums`` is False), so only data that no longer
    decodes is found. Damage is reported per leaf in the returned report, never raised; a
    root that is not a committed checkpoint, or whose fields are not even of their JSON
    types, raises.
    ``progress`` shows a bar of bytes read (default: when stderr is a terminal); the
    bytes, files and throughput are logged at the end.

    The root metadata is checked as restore checks it, every bad leaf reported rather than
    the first raised, so a checkpoint that verifies restores. Another format (``format`` and
    ``allow_pickle`` as for :func:`tsckpt.restore`) is checked as far as it allows: its
    metadata as it is parsed, every array read whole from its files."""
    RestoreOptions.of(locals())
    ck = open_checkpoint(directory, keep_bad=True, format=format, allow_pickle=allow_pickle)
    linked = _links(ck)  # before anything is read: these arrays are not
    with storage_errors(ck.location):
        nodes = _check_nodes(ck, linked) if not ck.foreign else _Nodes({}, ())  # another library's: opened and read
    skip = {**nodes.bad, **{p: "" for p in ck.arrays if _meets(p, linked)}}
    with Progress("verify", ck.location, show=progress) as bar:
        bar.set_total(sum(ck.array_metadata(p).nbytes for p in ck.arrays if p not in skip))
        reads = _read_all(ck, skip, bar)
    arrays = _record_paths(ck)
    return VerifyReport(
        location=str(ck.location),
        leaves=ck.leaves,
        n_arrays=len(arrays),
        n_values=len(ck.values),
        bad=_all_bad(ck, nodes, reads, linked),
        group_problems=nodes.group_problems,
        bytes_read=reads.bytes_read,
        files_read=reads.files_read,
        tree_problem=ck.tree_problem,
        arrays=arrays,
        format=ck.format,
        checksums=not ck.foreign,
        unread=tuple(sorted(p for p in linked if p not in ck.bad)),
    )


def _all_bad(ck: Checkpoint, nodes: _Nodes, reads: _Reads, linked: Mapping[str, str]) -> dict[str, str]:
    """Every bad leaf (sorted) with all that is wrong with it: its entry, node, data or links;
    a tied leaf is as bad as the array it reads."""
    bad = {**ck.bad, **nodes.bad}
    for path, why in [*reads.bad.items(), *linked.items()]:
        bad[path] = f"{bad[path]}; {why}" if path in bad else why
    for alias, stored in ck.aliases.items():
        if stored in bad:
            bad[alias] = f"tied to '{stored}', which is bad"
    return dict(sorted(bad.items()))


def _record_paths(ck: Checkpoint) -> tuple[str, ...]:
    """The paths of the root's array records, valid or not (sorted)."""
    records: Any = ck.raw.get("arrays")
    records = records if isinstance(records, list) else []
    arrays = {r["path"] for r in records if isinstance(r, dict) and isinstance(r.get("path"), str)} | set(ck.arrays)
    return tuple(sorted(arrays))
