"""The Hugging Face hub cache: snapshots whose files link into their repository's ``blobs/``.

huggingface_hub keeps a download in ``<cache>/models--ORG--NAME/`` (``datasets--``,
``spaces--`` likewise): each file's bytes once, in ``blobs/<hash>`` (the file's sha256, or
its git sha1), and each revision as ``snapshots/<commit>/``, whose files are relative links
``../../blobs/<hash>`` (a file ``d/f`` of the snapshot: ``../../../blobs/<hash>``), and
``refs/<branch>`` files naming a commit. A checkpoint holds no links (docs/security.md),
with this one exception, recognised strictly by :func:`blob`: the directory read is exactly
a snapshot (``<repo>/snapshots/<commit>``, found by its real path), and the link is a file
of it whose target is, as text, exactly the relative path to a blob of *that* repository
(``../`` as many times as the file is deep, ``blobs/``, a hex hash: no other repository's
blobs, no ``..`` escape, no absolute path). Such a file is then never opened through the
link: :func:`open_read` opens ``blobs/<hash>`` below the repository's own directory with no
symbolic link on the way (``openat2`` with ``RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH``, or
else one ``O_NOFOLLOW`` open per component), and reads it only if it is a regular file. A
link changed after it was checked therefore cannot redirect a read: what is read is a
regular file directly in the repository's ``blobs/``, whatever the link says.

:func:`snapshot_path` turns ``hf://ORG/NAME[@REVISION]`` into the snapshot directory of the
local cache (``HF_HUB_CACHE``, as huggingface_hub finds it), without any download.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import stat

from .._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LinkRefusedError,
    NotACheckpointError,
)
from .beneath import LINK_ERRNOS, READ_FLAGS, open_beneath, open_directory

SCHEME = "hf://"
_REPO = re.compile(r"(model|dataset|space)s--([^/]+)")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_HASH = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A snapshot directory of the Hugging Face cache."""

    repo_dir: str  # the real path of <cache>/<type>s--ORG--NAME
    kind: str  # "model", "dataset" or "space"
    repo: str  # ORG/NAME
    revision: str  # the commit


def snapshot(path: str) -> Snapshot | None:
    """The snapshot ``path`` is (by its real path, so a link to one counts), else None."""
    real = os.path.realpath(path)
    snapshots = os.path.dirname(real)
    repo_dir = os.path.dirname(snapshots)
    repo = _REPO.fullmatch(os.path.basename(repo_dir))
    if repo is None or os.path.basename(snapshots) != "snapshots" or not _COMMIT.fullmatch(os.path.basename(real)):
        return None
    return Snapshot(repo_dir, repo.group(1), repo.group(2).replace("--", "/"), os.path.basename(real))


class Blob(str):
    """The path of a snapshot's file (what messages name), whose bytes are read from
    ``rel`` (``blobs/<hash>``) below ``repo_dir`` by :func:`open_read`, never through the link."""

    repo_dir: str
    rel: str

    def __new__(cls, path: str, repo_dir: str, rel: str) -> Blob:  # noqa: PYI034 - a str made with fields
        made = super().__new__(cls, path)
        made.repo_dir = repo_dir
        made.rel = rel
        return made

    def __reduce__(self) -> tuple:  # type: ignore[type-arg]
        return (Blob, (str(self), self.repo_dir, self.rel))


def blob(root: str, rel: str, target: str) -> Blob | None:
    """The file ``rel`` (``/``-separated, already checked to name a place inside ``root``, its
    last component a link to ``target``) as a :class:`Blob` when ``root`` is a snapshot and
    ``target`` is exactly the relative path from the link to a blob of the snapshot's own
    repository; else None (the link is refused as any other). Opened once here, so a blob
    that is itself a link, or not a regular file, is refused now."""
    snap = snapshot(root)
    prefix = "../" * (rel.count("/") + 2) + "blobs/"
    if snap is None or not target.startswith(prefix) or not _HASH.fullmatch(target[len(prefix):]):
        return None
    found = Blob(os.path.join(root, *rel.split("/")), snap.repo_dir, target[len(prefix) - len("blobs/"):])
    os.close(open_read(found))
    return found


def open_read(path: str) -> int:
    """A descriptor, for reading, of the file at ``path``: a :class:`Blob` opened below its
    repository's directory, with no link on the way, and only if it is a regular file
    (LinkRefusedError, CorruptCheckpointError); any other path opened as ``os.open`` does,
    without waiting (a FIFO opens at once; the caller's ``fstat`` refuses it)."""
    if not isinstance(path, Blob):
        return os.open(path, READ_FLAGS)
    top = open_directory(path.repo_dir)
    try:
        fd = open_beneath(top, path.rel)
    except OSError as e:
        if e.errno in LINK_ERRNOS:
            where = os.path.join(path.repo_dir, path.rel)
            raise LinkRefusedError(
                f"{path}: links to {where}, which is a symbolic link or lies below one; tsckpt reads a Hugging Face "
                "cache snapshot's files only from regular files directly in the repository's blobs/ "
                "(docs/security.md): download the model again",
                link=str(path), target=where,
            ) from None
        if e.errno == errno.ENOENT:
            raise CorruptCheckpointError(
                f"{path}: links to {os.path.join(path.repo_dir, path.rel)}, which is missing (the download is "
                "incomplete): download the model again"
            ) from None
        raise
    finally:
        os.close(top)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(
            f"{path}: links to {os.path.join(path.repo_dir, path.rel)}, which is not a regular file; "
            "download the model again"
        )
    return fd


# ---- hf://ORG/NAME[@REVISION]: a snapshot of the local cache ------------------------------


def cache_dir() -> str:
    """The hub cache huggingface_hub uses: ``HF_HUB_CACHE`` (or ``HUGGINGFACE_HUB_CACHE``),
    else ``$HF_HOME/hub`` (``HF_HOME``: ``$XDG_CACHE_HOME/huggingface``, ``~/.cache/huggingface``),
    read from the environment now (huggingface_hub reads it once, when imported)."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expanduser(os.path.expandvars(hub))


def snapshot_path(url: str) -> str:
    """The local snapshot directory ``hf://ORG/NAME[@REVISION]`` names (a branch, tag or
    commit; default ``main``), found in :func:`cache_dir` without downloading anything:
    CheckpointNotFoundError naming the repository, and how to download it, when it is not
    there; NotACheckpointError (a ValueError) when ``url`` is not of that form."""
    body = url[len(SCHEME):]
    repo, _, revision = body.partition("@")
    revision = revision or "main"
    parts = repo.split("/")
    if not (1 <= len(parts) <= 2 and all(parts) and all(p not in (".", "..") and "--" not in p for p in parts)):
        raise NotACheckpointError(f"{url}: expected hf://ORG/NAME or hf://ORG/NAME@REVISION (a Hugging Face model id)")
    rev_parts = revision.split("/")
    if "" in rev_parts or "." in rev_parts or ".." in rev_parts or "\0" in revision:
        raise NotACheckpointError(f"{url}: {revision!r} is not a revision (a branch, tag or commit)")
    cache = cache_dir()
    repo_dir = os.path.join(cache, "models--" + "--".join(parts))
    commit = revision if _COMMIT.fullmatch(revision) else _ref(repo_dir, revision)
    path = os.path.join(repo_dir, "snapshots", commit) if commit is not None else None
    if path is None or not os.path.isdir(path):
        at = "" if revision == "main" else f" --revision {revision}"
        raise CheckpointNotFoundError(
            f"{url}: the model {repo!r}{'' if revision == 'main' else f' at revision {revision!r}'} is not in the "
            f"Hugging Face cache ({cache}); tsckpt reads hf:// from the cache only and downloads nothing: download it "
            f"first with `hf download {repo}{at}` (or huggingface_hub.snapshot_download({repo!r}"
            f"{'' if revision == 'main' else f', revision={revision!r}'})), or set HF_HUB_CACHE to the cache holding it"
        )
    return path


def _ref(repo_dir: str, revision: str) -> str | None:
    """The commit ``refs/<revision>`` of the repository names, or None."""
    try:
        with open(os.path.join(repo_dir, "refs", *revision.split("/")), encoding="utf-8") as f:
            commit = f.read(100).strip()
    except (OSError, ValueError):
        return None
    return commit if _COMMIT.fullmatch(commit) else None
