"""Paths inside a local checkpoint: confinement and symbolic links (docs/security.md).

Every format names files by paths it stores: tsckpt's array records, the files of a
Hugging Face index, a DCP checkpoint's data files, Orbax's items and arrays. Each such
path is checked here, by one rule, before anything is opened: :func:`path_problem`
(relative, ``/``-separated, no empty, ``.`` or ``..`` segment), and on a local disk
:func:`confined`, which also refuses a symbolic link on the way to it.

A check alone is not enough: whoever can write inside the checkpoint could swap a file
for a link after it. So no file of a local checkpoint is opened again by its path: the
checkpoint's directory is opened once (:class:`Root`; it may itself be a link), and
:func:`confined` returns a :class:`Confined` path that :func:`open_read` opens from that
descriptor with no link followed anywhere on the way (:mod:`.beneath`). TensorStore,
which opens files by path and follows links, reads a local checkpoint through a
:class:`~tsckpt._storage.mirror.Mirror` of descriptors opened so. The walk for links
(:func:`odd_files`) remains, to name every link of a checkpoint up front (``open``,
``verify``, before TensorStore reads).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import weakref
from typing import Any, NamedTuple

from .._errors import CorruptCheckpointError, LinkRefusedError, short_repr
from . import hfcache
from .beneath import LINK_ERRNOS, READ_FLAGS, open_beneath, open_directory, refuses_links

# How every refusal of a link says why, and what to do.
_LINK_WHY = (
    "tsckpt does not follow symbolic links in a checkpoint, which must hold its own files (a link could lead "
    "anywhere; docs/security.md)"
)
_LINK_FIX = "replace each link with a copy of its file"
# A Hugging Face cache snapshot: <cache>/<type>s--<owner>--<name>/snapshots/<revision>/<file>,
# each file a link to ../../blobs/<hash> (deeper files: more ../).
_HF_REPO = re.compile(r"(model|dataset|space)s--(.+)")
_HF_BLOB = re.compile(r"(?:\.\./)+blobs/[0-9a-fA-F]+")


def hf_cache_snapshot(path: str) -> tuple[str, str, str] | None:
    """(repo type, repo id, revision) when ``path`` lies in a Hugging Face cache snapshot
    (``.../models--org--name/snapshots/REV/...``), else None."""
    for candidate in dict.fromkeys((os.path.abspath(path), os.path.realpath(os.path.dirname(path) or "."))):
        parts = candidate.replace(os.sep, "/").split("/")
        for i in range(len(parts) - 2):
            repo = _HF_REPO.fullmatch(parts[i])
            if repo and parts[i + 1] == "snapshots" and parts[i + 2]:
                return repo.group(1), repo.group(2).replace("--", "/"), parts[i + 2]
    return None


def link_fix(path: str, target: str) -> str:
    """What to do about the link at ``path`` (to ``target``): for a Hugging Face cache
    snapshot, whose files link into its ``blobs/``, how to download a copy of real files."""
    snapshot = hf_cache_snapshot(path)
    if snapshot is None or not _HF_BLOB.fullmatch(target.replace(os.sep, "/")):
        return _LINK_FIX
    kind, repo, revision = snapshot
    flag = "" if kind == "model" else f" --repo-type {kind}"
    arg = "" if kind == "model" else f", repo_type={kind!r}"
    return (
        "this is a Hugging Face cache snapshot, whose files link into the cache's blobs/ (the download is intact): "
        f"get a copy that holds the files themselves with `hf download {repo} --revision {revision}{flag} "
        f"--local-dir DIR` (or huggingface_hub.snapshot_download({repo!r}, revision={revision!r}{arg}, "
        "local_dir=DIR)) and give DIR"
    )


def link_refused(message: str, path: str, target: str) -> LinkRefusedError:
    """The error of a refused link at ``path`` (to ``target``): ``message`` (where, and what is
    a link) followed by why links are refused and what to do."""
    return LinkRefusedError(f"{message}; {_LINK_WHY}: {link_fix(path, target)}", link=path, target=target)


def path_problem(rel: Any) -> str | None:
    """Why ``rel``, a path stored in a checkpoint, does not name a place inside it (it is not
    a relative ``/``-separated path of segments other than empty, ``.`` and ``..``, without
    NUL), or None. The one check of every stored path, whatever the format."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\0" in rel:
        return f"{short_repr(rel)} is not a relative path inside the checkpoint"
    parts = rel.split("/")  # list membership, not a generator: this runs once per stored array
    if "" in parts or "." in parts or ".." in parts:
        return f"{short_repr(rel)} is not a relative path inside the checkpoint"
    return None


class Root:
    """A local checkpoint's directory, opened once (it may itself be a link: the checkpoint
    the caller names may be one). Every stored path of it is opened from this descriptor
    (:func:`open_read`), never resolved from the directory's path again; closed when the
    last :class:`Confined` path of it goes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = open_directory(path)
        weakref.finalize(self, os.close, self.fd)


class Confined(str):
    """The path of a file stored in a local checkpoint (what messages name), whose bytes are
    read from ``rel`` below the checkpoint's open directory (:class:`Root`) by
    :func:`open_read`, with no symbolic link followed anywhere on the way: a file swapped
    for a link after it was checked fails its open, never reads the link's target."""

    root: Root
    rel: str
    where: str  # the file and field that named it, for messages
    field: str

    def __new__(cls, root: Root, rel: str, where: str, field: str) -> Confined:  # noqa: PYI034 - a str made with fields
        made = super().__new__(cls, os.path.join(root.path, *rel.split("/")))
        made.root, made.rel, made.where, made.field = root, rel, where, field
        return made

    def __reduce__(self) -> tuple:  # type: ignore[type-arg]
        return (_remade, (self.root.path, self.rel, self.where, self.field))


def _remade(root: str, rel: str, where: str, field: str) -> Confined:
    """A :class:`Confined` path in another process: the checkpoint's directory opened there."""
    return Confined(Root(root), rel, where, field)


def confined(root: str | Root, rel: Any, *, where: str, field: str) -> str:
    """``rel``, a path stored in the checkpoint at ``root`` (read from ``where``'s ``field``),
    checked to lie inside it: CorruptCheckpointError naming the file and the field if ``rel``
    leaves ``root``, LinkRefusedError if a component of it is a symbolic link, but for a file
    of a Hugging Face cache snapshot linking into its own repository's ``blobs/``
    (:func:`hfcache.blob`: a :class:`hfcache.Blob`, opened there, never through the link).
    Returns a :class:`Confined` path, which :func:`open_read` opens again below the
    directory's descriptor refusing any link, so a link planted after this check is refused
    too; a missing file is left to the caller, which says what it expected. Give a
    :class:`Root` to open the checkpoint's directory once for all its files."""
    why = path_problem(rel)
    if why is not None:
        raise CorruptCheckpointError(
            f"{where}: {field} {why}; the checkpoint is damaged or made to read elsewhere: use a trusted copy"
        )
    if not isinstance(root, Root):
        try:
            root = Root(directory := root)
        except OSError:  # no directory there: the caller's own check of the file says so
            return os.path.join(directory, *rel.split("/"))
    path = Confined(root, rel, where, field)
    try:
        fd = open_beneath(root.fd, rel)
    except OSError as e:
        if e.errno not in LINK_ERRNOS:
            return path  # missing or unreadable: the caller's read says so
        try:
            return _linked(path, e)
        except NotADirectoryError:
            return path  # a file on the way, no link: the caller's read says what is missing
    os.close(fd)
    return path


def open_read(path: str) -> int:
    """A descriptor, for reading (without waiting), of a file of a checkpoint: a
    :class:`Confined` path opened below its checkpoint's directory with no link followed
    (LinkRefusedError naming the link), a :class:`hfcache.Blob` in its repository's
    ``blobs/``, any other path (one the caller named) as ``os.open`` opens it. The one way
    every reader opens a checkpoint's files."""
    if isinstance(path, hfcache.Blob):
        return hfcache.open_read(path)
    if not isinstance(path, Confined):
        return os.open(path, READ_FLAGS)
    try:
        return open_beneath(path.root.fd, path.rel)
    except OSError as e:
        if e.errno not in LINK_ERRNOS:
            raise
        return hfcache.open_read(_linked(path, e))


def _linked(path: Confined, error: OSError) -> hfcache.Blob:
    """The :class:`hfcache.Blob` that ``path``, whose open met a link (``error``), stands for
    in a Hugging Face cache snapshot; else LinkRefusedError naming the link (found by looking
    at each component; one gone again since is named as the path that was a link), or
    ``error`` itself for a component that is a file, not a directory (ENOTDIR)."""
    root, rel = path.root.path, path.rel
    at = root
    for part in rel.split("/"):
        at = os.path.join(at, part)
        try:
            target = os.readlink(at)
        except OSError:
            continue  # not a link (or gone)
        rel_link = os.path.relpath(at, root).replace(os.sep, "/")
        found = hfcache.blob(root, rel, target) if rel_link == rel else None  # the file itself only
        if found is not None:
            return found
        raise link_refused(f"{path.where}: {path.field} {rel!r}: {rel_link} is a symbolic link (to {target})", at, target)
    if error.errno == errno.ENOTDIR:
        raise error
    raise changed_link(path)


def changed_link(path: Confined) -> LinkRefusedError:
    """The error of ``path``, whose open met a symbolic link that is gone again when looked at."""
    return LinkRefusedError(
        f"{path.where}: {path.field} {path.rel!r}: {path} was reached through a symbolic link when it was opened "
        f"(changed again since); {_LINK_WHY}: {_LINK_FIX}",
        link=str(path), target="",
    )


class Odd(NamedTuple):
    """An entry of a checkpoint directory that is neither a directory nor a regular file."""

    what: str  # "a symbolic link", or what the special file is ("a FIFO", "a socket", "a device")
    target: str | None  # a link's target


def odd_files(root: str) -> dict[str, Odd]:
    """Relative path (with ``/``) -> :class:`Odd`, for every symbolic link and every special
    file (FIFO, socket, device) below ``root``: readers refuse both, as a link could lead
    anywhere and opening a FIFO would wait for a writer forever. One walk of directory
    entries, whose type comes with the entry; only an odd one is looked at further."""
    found: dict[str, Odd] = {}
    stack = [root]
    while stack:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue  # unreadable directories are reported by the read that needs them
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
            elif not e.is_file(follow_symlinks=False):
                rel = os.path.relpath(e.path, root).replace(os.sep, "/")
                found[rel] = Odd("a symbolic link", _target(e.path)) if e.is_symlink() else Odd(_special(e), None)
    return dict(sorted(found.items()))


def _target(path: str) -> str:
    """The target of the link at ``path``, for a message (one replaced since it was listed: said so)."""
    try:
        return os.readlink(path)
    except OSError:
        return "(replaced while it was read)"


def _special(entry: os.DirEntry[str]) -> str:
    """What a special file is, for a message."""
    try:
        return file_kind(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        return "a special file"


def file_kind(mode: int) -> str:
    """What a file of ``mode`` that is no regular file is, for messages: "a FIFO", "a
    socket", "a device", "a directory", else "a special file"."""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a special file"


def odd_problem(rel: str, odd: Odd, root: str) -> tuple[str, str]:
    """What is wrong with the odd entry ``rel`` of the checkpoint at ``root``, and the fix, as
    every reader says them."""
    if odd.target is not None:
        return f"{rel} is a symbolic link (to {odd.target})", f"{_LINK_WHY}: {link_fix(os.path.join(root, rel), odd.target)}"
    return (
        f"{rel} is {odd.what}, not a regular file",
        "a checkpoint holds only directories and regular files: replace it with a copy of its file",
    )


def confined_opens() -> bool:
    """Whether :func:`open_beneath` refuses links here (``openat2``, or ``O_NOFOLLOW`` on
    each component); else it follows them, as ``open`` does, and readers walk for links first."""
    return refuses_links()


def owner(rel: str, arrays: list[str] | tuple[str, ...] | set[str]) -> str | None:
    """The array path whose files include ``rel`` (the longest matching prefix), or None."""
    return max((p for p in arrays if rel == p or rel.startswith(f"{p}/")), key=len, default=None)


def refuse_links(
    root: str | None, where: str, arrays: list[str] | tuple[str, ...] | set[str] = (), *, verify_lists: bool = True
) -> None:
    """Raise if the local checkpoint at ``root`` holds a symbolic link (LinkRefusedError) or a
    special file (CorruptCheckpointError) (:func:`odd_files`; None: not local). ``verify_lists``:
    the message says that ``tsckpt verify`` lists them all (it does for tsckpt's own format)."""
    if root is None:
        return
    found = odd_files(root)
    if not found:
        return
    links = {rel: odd for rel, odd in found.items() if odd.target is not None}
    rel, odd = next(iter((links or found).items()))  # a link first: its error is its own
    leaf = owner(rel, arrays)
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    what, fix = odd_problem(rel, odd, root)
    listed = " (`tsckpt verify` lists them)" if verify_lists else ""
    message = f"{where}: {f'leaf {leaf!r}: ' if leaf else ''}{what}{more}; {fix}{listed}"
    if odd.target is not None:
        raise LinkRefusedError(message, link=os.path.join(root, rel), target=odd.target)
    raise CorruptCheckpointError(message)
