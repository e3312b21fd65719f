"""Incremental saves: each file whose content equals the base checkpoint's is shared with
it (a hard link; on S3 a server-side copy, :class:`ObjectSharer`), every other file written.

A file is shared only when that is proven: its array's record (dtype, shape, chunking,
kind) is the base's, the content hash of the data it would hold
(:mod:`tsckpt._codec.contenthash`) is the one the base recorded for the same file (under
the base's key: a base of an older format names a one-file array's file ``c/0`` where this
save names it ``c.0``), and the
base's file is still the one its save wrote: after the link, its size, modification time
and inode are those the base recorded once its files were durable (a file rewritten or
edited in place since, even to the same size, has another modification time or inode),
and it is the very file reached below the base's directory through no symbolic link.
Anything else (no base, another layout, a file missing or changed, a link refused) writes
the file, as a full save does. The files stay standard zarr files: a later step holds its
own directory entries, so deleting the base (retention) leaves it whole.

The hash of a file whose source is a tensor torch's version counter shows unchanged since
this process hashed it is taken from then, its data not read (:mod:`.versions`).

Each rank records, per file, its hash and the file's size, modification time and inode
(``content`` in the root metadata, docs/format.md): a written file's as its write thread
closes it, a shared file's once the files are durable; a file shared whose base changed
during the save fails the save (:meth:`Sharer.recorded`). A shard file of several inner
chunks the own writer wrote also has its inner chunks' hashes recorded, as the writer
hashed them; a file shared takes those the base recorded for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._base.lazytorch import is_tensor
from .._codec import contenthash
from .._coord.torchdist import torch_initialized
from .._errors import CheckpointNotFoundError, NotACheckpointError, StorageError, TsckptError
from .._ondisk import root as _root
from .._ondisk.arrays import same_cell_key
from .._ondisk.records import (
    LAYOUT_PLAIN, ROOT_KEY, ArrayRecord, ContentEntry, content_chunks, content_entries, content_etags,
)
from .._ondisk.stepindex import STEP
from .._storage.beneath import open_beneath, open_directory
from .._storage.faults import leaf_of_key
from .._storage.locations import Directory, Location, resolve
from .._storage.s3copy import Copier
from . import versions as _versions

log = logging.getLogger("tsckpt")

# How far a file system's timestamps may lag the clock (they are stamped from a clock that
# advances once per kernel tick), and for one whose timestamps are whole seconds.
CLOCK_TICK_NS = 20_000_000
COARSE_TICK_NS = 2_000_000_000
# The clock a Linux file system stamps times from (CLOCK_REALTIME_COARSE; a fine-grained
# stamp is never behind it): read, it says when the tick has passed, rather than a bound.
STAMP_CLOCK = getattr(time, "CLOCK_REALTIME_COARSE", 5 if sys.platform.startswith("linux") else None)


@dataclasses.dataclass(frozen=True)
class Base:
    """What a save shares with: the base's local directory (and a descriptor of it, open until
    :meth:`close`), its records, recorded files and their inner chunks' hashes."""

    directory: str
    dir_fd: int
    records: Mapping[str, ArrayRecord]
    files: Mapping[str, ContentEntry]
    chunks: Mapping[str, tuple[str, ...]]

    def close(self) -> None:
        os.close(self.dir_fd)

    def link(self, key: str, rec: ArrayRecord, digest: str, dest: str) -> str | None:
        """Link the base's file of this save's file ``key`` at ``dest`` if it provably holds what
        this save would write there (see the module's docstring): its key in the base; None,
        with nothing left at ``dest``, if not."""
        theirs = _their_key(self.records, self.files, key, rec, digest)
        if theirs is None:
            return None
        key, entry = theirs, self.files[theirs]
        try:
            os.link(os.path.join(self.directory, key), dest, follow_symlinks=False)
        except OSError:
            return None  # gone (the base deleted), too many links, another file system: written instead
        try:
            st = os.lstat(dest)
            if stat.S_ISREG(st.st_mode) and (st.st_size, st.st_mtime_ns, st.st_ino) == entry[1:] and self._inside(key, st):
                return key
        except OSError:
            pass
        os.unlink(dest)  # never written through: that would change the base's file too
        return None


    def _inside(self, key: str, linked: os.stat_result) -> bool:
        """Whether the file linked is the base's own file ``key``, reached below its directory
        through no symbolic link (a link on the way would have led the link outside the base)."""
        try:
            fd = open_beneath(self.dir_fd, key)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return (st.st_dev, st.st_ino) == (linked.st_dev, linked.st_ino)


def _their_key(
    records: Mapping[str, ArrayRecord], files: Mapping[str, ContentEntry], key: str, rec: ArrayRecord, digest: str
) -> str | None:
    """The base's key of this save's file ``key`` (of array ``rec``, hash ``digest``) where the
    base recorded an array of the same record and that file with that hash, else None."""
    theirs = records.get(rec.path)
    if theirs is None or (theirs.shape, theirs.dtype, theirs.kind, theirs.chunking) != (
        rec.shape, rec.dtype, rec.kind, rec.chunking
    ):
        return None
    key = same_cell_key(key, rec, theirs)
    entry = files.get(key)
    return key if entry is not None and entry[0] == digest else None


# Objects smaller than this are written again rather than copied: a copy is a request as a PUT
# is, and moves no byte through the client, which for a few KiB saves nothing (a copy of 1,000
# objects of a few bytes took 9.5 s where their PUTs took 5.9 s on a moto server).
COPY_MIN_BYTES = 64 << 10


@dataclasses.dataclass(frozen=True)
class ObjectBase:
    """What a save on an object store shares with: the base's records, recorded files, their
    objects' ETags and inner chunks' hashes, and the copier that makes server-side copies of them."""

    records: Mapping[str, ArrayRecord]
    files: Mapping[str, ContentEntry]
    etags: Mapping[str, str]
    chunks: Mapping[str, tuple[str, ...]]
    copier: Copier

    def copy(self, key: str, rec: ArrayRecord, digest: str) -> tuple[str, str, int] | None:
        """Copy the base's object of this save's file ``key`` (hash ``digest``) to ``key`` if it
        provably holds what this save would write there: the base recorded the same hash
        for it and the object is still the one its save wrote (the copy is conditional on
        its recorded ETag). The base's key, the copy's ETag and its size; None if not copied."""
        theirs = _their_key(self.records, self.files, key, rec, digest)
        etag = None if theirs is None else self.etags.get(theirs)
        if theirs is None or etag is None or self.files[theirs][1] < COPY_MIN_BYTES:
            return None
        new = self.copier.copy(theirs, key, etag)
        return None if new is None else (theirs, new, self.files[theirs][1])


def _same_object_location(a: Location, b: Location) -> bool:
    """Whether two object-store locations are one: the same driver, bucket, endpoint and path."""
    keys = ("driver", "bucket", "endpoint", "path")
    return all(a.spec.get(k) == b.spec.get(k) for k in keys)


def check_base(base: Directory | None, target: Location, *, incremental: Any = True) -> None:
    """Refuse, before the save claims ``target``, a base given with ``incremental=False`` (which
    shares nothing), a base that is the target itself (its claim would clear what it shares),
    and a local base that is no checkpoint: missing, a file, or a directory without a root
    (a manager's root named instead of one of its steps)."""
    if base is None:
        return
    loc = resolve(base)
    if not incremental:
        raise ValueError(
            f"base {loc} with incremental=False: a base is shared with only by an incremental save; pass "
            "incremental=True (or 'versions'), or drop base"
        )
    if loc.local is None and target.local is None and target.spec.get("driver") == "s3" and _same_object_location(loc, target):
        raise ValueError(f"base {loc} is the checkpoint being saved; pass a previous checkpoint as base")
    if loc.local is None or target.local is None:
        return
    if os.path.realpath(loc.local) == os.path.realpath(target.local):
        raise ValueError(f"base {loc} is the checkpoint being saved; pass a previous checkpoint as base")
    if os.path.exists(loc.local) and not os.path.isdir(loc.local):
        raise NotACheckpointError(
            f"base {loc}: a file, not a tsckpt checkpoint's directory; an incremental save shares files with a "
            "previous tsckpt checkpoint: pass one, or base=None"
        )
    if not os.path.isdir(loc.local):
        raise CheckpointNotFoundError(f"base {loc}: no checkpoint there; pass an existing checkpoint, or base=None")
    if not os.path.lexists(os.path.join(loc.local, ROOT_KEY)):
        steps = sorted((n for n in os.listdir(loc.local) if STEP.fullmatch(n)), key=int)
        hint = (
            f" (it holds steps of a CheckpointManager, such as {steps[-1]}: pass one of them)" if steps else ""
        )
        raise NotACheckpointError(
            f"base {loc}: not a tsckpt checkpoint, no {ROOT_KEY} there{hint}; pass a previous checkpoint's "
            "directory, or base=None"
        )


def open_base(base: Directory | None, target: Location) -> Base | None:
    """The base of a save into ``target``, None when there is nothing to share with: no base,
    a base or target not a local plain checkpoint, or a base no longer there or no longer
    committed (deleted since :func:`check_base`; logged): then every file is written."""
    if base is None:
        return None
    loc = resolve(base)
    if loc.local is None or target.local is None:
        if loc.spec.get("driver") != "s3" or target.spec.get("driver") != "s3":
            log.info(
                "incremental save: base %s and %s are not both on a local file system nor both on S3 (files are "
                "shared by hard links or server-side copies); every file is written", loc, target,
            )
        return None
    try:
        ck = _root.load(loc)
        if ck.raw.get("layout", LAYOUT_PLAIN) != LAYOUT_PLAIN:
            log.info("incremental save: base %s is not in the plain layout; every file is written", loc)
            return None
        dir_fd = open_directory(loc.local)
    except (TsckptError, OSError) as e:
        log.info("incremental save: base %s cannot be read (%s); every file is written", loc, e)
        return None
    return Base(loc.local, dir_fd, dict(ck.arrays), content_entries(ck.raw), content_chunks(ck.raw))


def open_object_base(base: Directory | None, target: Location) -> ObjectBase | None:
    """The base of a save into ``target`` on S3, None when nothing can be copied from it: no
    base, not a committed plain checkpoint in the same bucket through the same endpoint,
    no ETag recorded, or no copier (boto3 not installed; logged once): every file is written."""
    if base is None:
        return None
    loc = resolve(base)
    if loc.spec.get("driver") != "s3":
        log.info("incremental save: base %s is not on S3 as %s is; every file is written", loc, target)
        return None
    copier = Copier.between(loc, target)
    if copier is None:
        return None
    try:
        ck = _root.load(loc)
    except TsckptError as e:
        log.info("incremental save: base %s cannot be read (%s); every file is written", loc, e)
        return None
    if ck.raw.get("layout", LAYOUT_PLAIN) != LAYOUT_PLAIN:
        log.info("incremental save: base %s is not in the plain layout; every file is written", loc)
        return None
    etags = content_etags(ck.raw)
    if not etags:
        log.info("incremental save: base %s records no object ETags; every file is written", loc)
        return None
    return ObjectBase(dict(ck.arrays), content_entries(ck.raw), etags, content_chunks(ck.raw), copier)


def sharer_for(target: Location, layout: str, incremental: Any, base: Directory | None) -> Sharer | None:
    """The :class:`Sharer` of one rank's save into ``target`` (``incremental``: the save's
    option), None where nothing is recorded or shared: incremental off, or a layout or store
    other than the plain layout on a local file system or S3 (logged when a base was given)."""
    if not incremental:
        return None
    versions = incremental == "versions"
    if versions:
        _warn_collectives()
    if layout == LAYOUT_PLAIN and target.local is not None:
        return Sharer(target.local, open_base(base, target), versions=versions)
    if layout == LAYOUT_PLAIN and target.spec.get("driver") == "s3":
        return ObjectSharer(open_object_base(base, target), versions=versions)
    if base is not None:
        why = (
            "the compact layout's files are databases, not a file per chunk" if layout != LAYOUT_PLAIN
            else f"{target} is on neither a local file system nor S3"
        )
        log.info("incremental save into %s shares nothing with its base (%s); every file is written", target, why)
    return None


_collectives_warned = False


def _warn_collectives() -> None:
    """Once per process, where torch.distributed runs several ranks: its collectives write
    into their tensors without moving torch's version counters (:mod:`.versions`)."""
    global _collectives_warned
    if _collectives_warned or not torch_initialized():
        return
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        _collectives_warned = True
        warnings.warn(
            'incremental="versions" under torch.distributed: collectives that write into a tensor in place '
            "(broadcast, all_reduce, reduce, scatter, recv/irecv, all_to_all_single) do not move its version "
            "counter, so a saved tensor written only by one of them since the previous save keeps its old "
            'bytes in the new step. Use incremental=True (every file hashed) where a saved tensor is written '
            "by a collective (a model synchronised or averaged across ranks); docs/incremental.md.",
            RuntimeWarning,
            stacklevel=2,
        )


# Where a file's data comes from, for a hash known without reading it (:mod:`.versions`):
# the leaf's tensor, its state before the save read it, and the file's box of it.
Proof = tuple[Any, _versions.State, _versions.Box]


class Sharer:
    """One rank's files of an incremental save: each hashed, then shared or written (by the
    write threads, through :meth:`put`). ``versions``: a file's hash may be known from an
    earlier save of the same unchanged tensor (:mod:`.versions`; only with ``incremental="versions"``)."""

    def __init__(self, directory: str, base: Base | None, *, versions: bool = False) -> None:
        self.directory, self.base, self.versions = directory, base, versions
        self.hashes: dict[str, str] = {}  # the shared files' hashes
        self.written: dict[str, ContentEntry] = {}  # the written files' entries
        self.shared: dict[str, str] = {}  # this save's key -> the base's key of the file shared
        self._states: dict[int, tuple[Any, _versions.State | None]] = {}
        self.known: set[str] = set()  # files whose hash was known, their data not read
        self.etags: dict[str, str] = {}  # on an object store: each file's object's ETag
        self.chunks: dict[str, tuple[str, ...]] = {}  # shard files' inner chunks' hashes

    def proof(self, data: Any, region: tuple[str, tuple[int, ...]], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Proof | None:
        """The :data:`Proof` of the file of box (``offsets``, ``lengths``) of a leaf's local
        ``data`` (``region``: its stored dtype and offsets), None where no proof is possible.
        The data's state is taken once per save, at its first file, before any is read."""
        if not self.versions or not is_tensor(data):
            return None
        got = self._states.get(id(data))
        if got is None or got[0] is not data:
            got = self._states[id(data)] = (data, _versions.state(data))
        return None if got[1] is None else (data, got[1], (*region, offsets, lengths))

    def put(
        self, key: str, rec: ArrayRecord, src: np.ndarray, write: Callable[[], Any], proof: Proof | None = None,
    ) -> None:
        """Hash ``src``, the data of file ``key`` (or take the hash ``proof`` proves known);
        share the base's file, or ``write()`` it (which may return the file's status as
        written; on an object store, its ETag and size)."""
        digest = None if proof is None else _versions.known(*proof)
        if digest is not None:
            self.known.add(key)
        else:
            digest = contenthash.digest(src)
            if proof is not None:
                _versions.remember(*proof, digest)
        if self._share(key, rec, digest):
            return
        self._wrote(key, digest, write())

    def _wrote(self, key: str, digest: str, got: Any) -> None:
        """Record file ``key`` of hash ``digest`` as written (``got``: what its write returned)."""
        st = got or os.lstat(os.path.join(self.directory, key))  # here, on the write threads: its size, time and inode are final
        self.written[key] = (digest, st.st_size, st.st_mtime_ns, st.st_ino)

    def share_known(self, key: str, rec: ArrayRecord, proof: Proof) -> bool:
        """Share file ``key`` with the base, its data never read, where ``proof`` shows its hash
        known (:mod:`.versions`) and the base's file provably holds it: True, the file is
        done; False, it goes to :meth:`put` (its directory made). A frozen base's files take
        this way in the calling thread, not a write thread's turn each."""
        digest = _versions.known(*proof)
        if digest is None or self.base is None:
            return False
        if self._share(key, rec, digest):
            self.known.add(key)
            return True
        return False

    def _share(self, key: str, rec: ArrayRecord, digest: str) -> bool:
        """Link the base's file for file ``key`` of hash ``digest`` where proven equal (:meth:`Base.link`)."""
        base = self.base
        theirs = None if base is None else base.link(key, rec, digest, os.path.join(self.directory, key))
        if theirs is None or base is None:
            return False
        self.hashes[key] = digest
        self.shared[key] = theirs
        self._carry_chunks(key, theirs, base.chunks)
        return True

    def wrote_chunks(self, key: str, digests: list[str] | None) -> None:
        """Record the hashes of the inner chunks of shard file ``key`` as its writer hashed them
        (:func:`.shardwrite.write_shard`): of a file of several inner chunks only (the hash of
        one is the file's)."""
        if digests is not None and len(digests) > 1:
            self.chunks[key] = tuple(digests)

    def _carry_chunks(self, key: str, theirs: str, base_chunks: Mapping[str, tuple[str, ...]]) -> None:
        """A file shared from the base's ``theirs`` keeps the inner chunks' hashes the base recorded."""
        got = base_chunks.get(theirs)
        if got is not None:
            self.chunks[key] = got

    def close(self) -> None:
        """Close the base's directory (once every file is shared or written)."""
        if self.base is not None:
            self.base.close()

    def recorded(self) -> dict[str, ContentEntry]:
        """Every file's entry once the files are durable (the shared files' stat'd again now).
        A shared file whose base changed since the base recorded it (edited during this save)
        raises: the step would not hold what was saved."""
        out: dict[str, ContentEntry] = dict(self.written)
        newest = max((e[2] for e in out.values()), default=-1)
        for key, digest in self.hashes.items():  # the shared files: stat again once durable
            path = os.path.join(self.directory, key)
            st = os.lstat(path)
            out[key] = (digest, st.st_size, st.st_mtime_ns, st.st_ino)
            newest = max(newest, st.st_mtime_ns)
            if self.base is not None and self.base.files[self.shared[key]][1:] != out[key][1:]:
                raise StorageError(
                    f"{path}: the base's file {self.shared[key]} changed while this incremental save shared it, so this step "
                    "would not hold what was saved; save again (with base=None for a full save)",
                    filename=path, leaf=leaf_of_key(key),
                )
        if out:
            settle_clock(newest, fine=any(e[2] % 1_000_000_000 for e in out.values()))
        return out


class ObjectSharer(Sharer):
    """One rank's files of an incremental save on S3: each hashed, then copied from the base
    on the store (:meth:`ObjectBase.copy`) or written, by the write threads (:meth:`put`);
    each file's entry records its hash and size (no time or inode: 0 and 0), and its
    object's ETag as written or copied, which the next save's copies are conditional on."""

    def __init__(self, base: ObjectBase | None, *, versions: bool = False) -> None:
        super().__init__("", None, versions=versions)
        self.object_base = base

    def share_known(self, key: str, rec: ArrayRecord, proof: Proof) -> bool:
        return False  # a copy is a request: on the write threads, through put()

    def _share(self, key: str, rec: ArrayRecord, digest: str) -> bool:
        got = None if self.object_base is None else self.object_base.copy(key, rec, digest)
        if got is None:
            return False
        theirs, etag, size = got
        self.written[key] = (digest, size, 0, 0)
        self.etags[key] = etag
        self.shared[key] = theirs
        if self.object_base is not None:
            self._carry_chunks(key, theirs, self.object_base.chunks)
        return True

    def _wrote(self, key: str, digest: str, got: Any) -> None:
        """``got``: the object's ETag as written (None when the store gave none) and its size."""
        etag, size = got
        self.written[key] = (digest, size, 0, 0)
        if etag is not None:
            self.etags[key] = etag

    def close(self) -> None:
        """Say how many copies were refused (each file written instead)."""
        base = self.object_base
        if base is not None and base.copier.refused:
            log.info(
                "incremental save on S3: %d copies from the base were refused or failed (the base's objects changed "
                "or are gone); those files were written", base.copier.refused,
            )

    def recorded(self) -> dict[str, ContentEntry]:
        """Every file's entry (its object's ETag in :attr:`etags`): an object copied is its own,
        so nothing of the base is checked again."""
        return dict(self.written)


def settle_clock(newest_ns: int, *, fine: bool) -> None:
    """Wait until the file system's clock has passed ``newest_ns``, the newest modification
    time recorded, so that a file changed after this save, however soon, gets a later one
    (a file system stamps times from a clock that ticks every few milliseconds: a change
    within the same tick would keep the recorded time). ``fine``: the file system stamps
    nanoseconds (else whole seconds, as some do). Where the stamping clock can be read
    (:data:`STAMP_CLOCK`), until it has passed ``newest_ns``, within the bound of a tick."""
    tick = CLOCK_TICK_NS if fine else COARSE_TICK_NS
    deadline = newest_ns + tick
    if fine and STAMP_CLOCK is not None:
        try:
            while (now := time.clock_gettime_ns(STAMP_CLOCK)) <= newest_ns and time.time_ns() < deadline:
                time.sleep((newest_ns - now) / 1e9 + 0.0005)
            return
        except OSError:  # no such clock here: the bound
            pass
    wait = deadline - time.time_ns()
    if wait > 0:
        time.sleep(wait / 1e9)
