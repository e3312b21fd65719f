"""The options of tsckpt's verbs, each defined once: name, type, default, check and meaning.

Several verbs do the same thing in different settings: ``save``,
``save_async``, ``CheckpointManager.save`` / ``save_async`` and
``tsckpt.torch.save`` write a checkpoint; ``restore``,
``CheckpointManager.restore``, ``tsckpt.torch.restore`` and ``convert`` read
one. Their options are declared here once, as the fields of
:class:`SaveOptions`, :class:`AsyncOptions` and :class:`RestoreOptions`.

Each verb keeps an explicit, typed signature (what users, IDEs and type
checkers see): data positional, options keyword-only. It is declared with
:func:`verb`, which checks when tsckpt is imported that the signature takes
every option of the verb's sets under the same name, with the same default
and annotation, except the options :data:`VERBS` lists as making no sense on
that verb, each with the reason. A verb whose signature drifts from its twins'
therefore fails at import, naming the difference (tests/test_options.py
compares the twins too). Inside, a verb gathers its arguments into one options
object (``SaveOptions.of(locals())`` on entry), which checks every value before
any work, and hands the whole object on, so every option it takes reaches the
verb underneath. A verb that coordinates ranks gathers them with ``checked``
instead and raises a bad value's error in its first exchange with the other
ranks, so that they raise with it instead of waiting for it.

Conventions:

* ``timeout`` is a :class:`datetime.timedelta` on every verb (default: 10
  minutes for each wait on other ranks). :meth:`tsckpt.AsyncSave.result` and
  ``exception`` take a timedelta too, and float seconds as
  :class:`concurrent.futures.Future` does (:func:`timeout_seconds`).
* ``max_inflight_bytes`` bounds the data in flight, which bounds the memory a
  verb needs beyond the state: 512 MiB of source data handed to storage when
  saving, 32 MiB of reads when restoring. ``convert`` reads its source as it
  writes, and its window is the read side's (32 MiB).
* ``progress`` shows a bar on rank 0: True, False, or None for "when stderr is
  a terminal".

CheckpointManager: options that say how a run's checkpoints are written and
coordinated (``group``, ``timeout``, ``check_replicas``, ``layout``) and how
its background worker behaves (``if_busy``, ``max_staging_bytes``, ``staging``, ``writer``) are given
once, to the constructor, and hold for every step: the steps of one run share
a process group, a layout and one set of staging buffers. Options of a single
call (``overwrite``, ``max_inflight_bytes``, ``progress``; when restoring
``strict``, ``inplace``, ``as_saved``, ``casting``, ``copy``) are keywords of each
method, exactly as on the module-level verbs.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import os
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, Union

from ._base.casting import check_casting
from ._base.mapping import Rules
from ._ondisk.records import LAYOUT_PLAIN, check_layout
from ._runtime import fork as _fork

# Bytes of source data handed to storage but not yet written; bounds the
# extra host memory a save needs beyond the state itself.
WRITE_WINDOW_BYTES = 512 << 20
# Bytes read from storage but not yet copied into their destination. tsckpt's own
# reader (_shardread) holds exactly this much scratch, 4 MiB per reading thread: 32 MiB
# kept 8 direct reads of 4 MiB in flight, which read cold files 15-25% faster than 16 MiB.
# TensorStore decodes on several threads, each holding its own heap, so the resident
# memory its reads add is a few times this (measured: 16 MiB gave 37-41 MiB over a live
# 576 MiB or 1.7 GiB model and optimizer; 64 MiB gave 104-190 MiB).
READ_WINDOW_BYTES = 32 << 20

# ``base=``: a checkpoint as every verb takes one (tsckpt._storage.locations.Directory), or None.
BaseDirectory = Union[str, os.PathLike, dict, None]  # type: ignore[type-arg]
IfBusy = Literal["wait", "error"]
IF_BUSY = ("wait", "error")
Staging = Literal["blocking", "overlapped"]
STAGING = ("blocking", "overlapped")
Writer = Literal["process", "thread"]
Incremental = bool | Literal["versions"]  # "versions": CPU tensors torch's version counters show unchanged are not hashed again
WRITERS = ("process", "thread")
# ``copy=``: True (new memory), False (copy-on-write mappings of the files), "read-only" (numpy arrays read-only).
Copy = Union[bool, Literal["read-only"]]
READ_ONLY = "read-only"

_O = TypeVar("_O", bound="_Options")
_F = TypeVar("_F", bound=Callable[..., Any])


# ---- value checks ---------------------------------------------------------------------


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {value!r} ({type(value).__name__})")


def _incremental(name: str, value: Any) -> None:
    if not isinstance(value, bool) and value != "versions":
        raise TypeError(
            f"{name} must be True, False or \"versions\" (trust torch's version counters), not {value!r} "
            f"({type(value).__name__})"
        )


def _bar(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True (show a bar), False (never) or None (when stderr is a terminal), "
            f"not {value!r} ({type(value).__name__})"
        )


def _timeout(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, datetime.timedelta):
        raise TypeError(
            f"{name} must be a datetime.timedelta or None, not {value!r} ({type(value).__name__}); "
            "write e.g. timeout=datetime.timedelta(minutes=10)"
        )
    if value <= datetime.timedelta(0):
        raise ValueError(f"{name} must be positive, not {value}")


def _byte_count(name: str, value: Any, *, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of bytes, not {value!r} ({type(value).__name__})")
    if value < least:
        raise ValueError(f"{name} must be at least {least} byte{'s' if least != 1 else ''}, not {value}")


def _window(name: str, value: Any) -> None:
    _byte_count(name, value, least=1)


def _staging(name: str, value: Any) -> None:
    if value is not None:
        _byte_count(name, value, least=0)


def _layout(name: str, value: Any) -> None:
    check_layout(value)


def _casting(name: str, value: Any) -> None:
    check_casting(value)


def _rules(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, Rules):
        raise TypeError(
            f"{name} must be a tsckpt.mappings.Rules (e.g. tsckpt.mappings.flax_to_torch(), or "
            f"Rules([Rule(...), ...])) or None, not {value!r} ({type(value).__name__})"
        )


def _if_busy(name: str, value: Any) -> None:
    if value not in IF_BUSY:
        raise ValueError(f"{name} must be 'wait' or 'error', not {value!r}")


def _staging_mode(name: str, value: Any) -> None:
    if value not in STAGING:
        raise ValueError(f"{name} must be 'blocking' or 'overlapped', not {value!r}")


def _writer(name: str, value: Any) -> None:
    if value not in WRITERS:
        raise ValueError(f"{name} must be 'process' or 'thread', not {value!r}")


def _copy(name: str, value: Any) -> None:
    if not isinstance(value, bool) and value != READ_ONLY:
        raise ValueError(
            f"{name} must be True (new memory), False (map the stored bytes, copy-on-write) or {READ_ONLY!r} "
            f"(mapped, numpy arrays read-only), not {value!r}"
        )


def _format(name: str, value: Any) -> None:
    from ._formats.sources import FORMATS

    if value is not None and value not in FORMATS:
        raise ValueError(f"{name} must be None (detected) or one of {', '.join(FORMATS)}, not {value!r}")


def _directory_or_none(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike, dict)):
        raise TypeError(
            f"{name} must be a directory (a str or path, or a kvstore spec dict) or None, not {value!r} "
            f"({type(value).__name__})"
        )


def _option(default: Any, doc: str, check: Callable[[str, Any], None] | None = None) -> Any:
    """A field of an option set: its default, what it does (``doc``) and how its value is checked."""
    return dataclasses.field(default=default, metadata={"doc": doc, "check": check})


# ---- the option sets ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Options:
    """What the option sets share: values checked on creation, gathered from a verb's arguments."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                check(f.name, getattr(self, f.name))

    @classmethod
    def of(cls: type[_O], arguments: Mapping[str, Any], base: _O | None = None) -> _O:
        """The options among a verb's ``arguments`` (its ``locals()`` on entry), the others
        as in ``base`` (default: their defaults). Raises TypeError or ValueError for a bad value."""
        given = {f.name: arguments[f.name] for f in dataclasses.fields(cls) if f.name in arguments}
        return cls(**given) if base is None else dataclasses.replace(base, **given)

    @classmethod
    def checked(cls: type[_O], arguments: Mapping[str, Any], base: _O | None = None) -> tuple[_O, Exception | None]:
        """:meth:`of`, but a bad value does not raise here: it gives way to its default (or
        ``base``'s) and its error is returned beside the options. A verb that coordinates ranks
        raises that error from within its first exchange with the others, so that every rank
        raises at once, rather than this one alone while the others wait out the timeout (a
        value computed per rank, such as a window from the free memory, can be bad on one)."""
        try:
            return cls.of(arguments, base), None
        except (TypeError, ValueError) as e:
            good = {}
            for f in dataclasses.fields(cls):
                if f.name not in arguments:
                    continue
                check = f.metadata.get("check")
                try:
                    if check is not None:
                        check(f.name, arguments[f.name])
                except (TypeError, ValueError):
                    continue
                good[f.name] = arguments[f.name]
            return cls.of(good, base), e

    def kwargs(self) -> dict[str, Any]:
        """Every option by name, to pass on to the verb underneath."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class SaveOptions(_Options):
    """How a checkpoint is written: the options of every verb that saves."""

    overwrite: bool = _option(False, "Replace an existing checkpoint (never one whose save is still running).", _flag)
    group: Any = _option(
        None, "The torch.distributed process group whose ranks save together (default: the default group)."
    )
    check_replicas: bool = _option(True, "Compare regions that several ranks hold by checksum.", _flag)
    timeout: datetime.timedelta | None = _option(None, "Bound on every wait on other ranks.", _timeout)
    max_inflight_bytes: int = _option(
        WRITE_WINDOW_BYTES,
        "Source data handed to storage but not yet written: the host memory a save needs beyond the "
        "state itself. No shard file is made larger than the smallest window of any rank.",
        _window,
    )
    layout: str = _option(
        LAYOUT_PLAIN,
        '"plain": files per array, readable by any zarr v3 tool; "compact": one OCDBT database per '
        "writing rank, merged at the commit (few files whatever the number of leaves).",
        _layout,
    )
    inner_chunks: bool = _option(
        True,
        "Store an array larger than one inner chunk (512 KiB) as shard files of inner chunks, so that a slice "
        "reads only the chunks it touches (a tensor-parallel column half its columns); False: each shard file "
        "is one chunk (each writer's region, in row blocks of at most 256 MiB), which restore(copy=False) maps "
        "instead of copying, a partial read then reading whole files (docs/zerocopy.md).",
        _flag,
    )
    progress: bool | None = _option(
        None, "A bar of bytes written on rank 0 (None: when stderr is a terminal).", _bar
    )
    incremental: Incremental = _option(
        True,
        "Record a content hash of every file (a later save may share the files with this one), and share "
        "with ``base`` every file whose content is proven equal (plain layout on a local file system or S3; "
        "False: neither, every file written as before). \"versions\": also a CPU tensor that torch's "
        "version counter shows unchanged since this process hashed it is not hashed again, for programs "
        "that never write tensors unseen by that counter (through ``.data``, numpy views or the storage; "
        "docs/incremental.md).",
        _incremental,
    )
    base: BaseDirectory = _option(
        None,
        "A previous committed checkpoint whose files this save shares, by hard links (on S3: server-side "
        "copies), where their content is unchanged (docs/incremental.md); None: every file written.",
        _directory_or_none,
    )


@dataclasses.dataclass(frozen=True)
class AsyncOptions(_Options):
    """How a save in the background behaves: the options of the verbs that save asynchronously."""

    if_busy: IfBusy = _option(
        "wait", "When an earlier asynchronous save is still running: wait for it, or raise SaveInProgressError.",
        _if_busy,
    )
    max_staging_bytes: int | None = _option(
        None,
        "The most array bytes copied to host memory for a background save; a larger state is saved "
        "synchronously instead, with a RuntimeWarning (None: no limit).",
        _staging,
    )
    staging: Staging = _option(
        "overlapped",
        '"blocking": every array is copied to host memory before the call returns; "overlapped": the '
        "parameters and state of the optimizers saved are copied in the background while training goes "
        "on, each optimizer's next step held back until its tensors are copied (everything else is copied "
        "before the call returns).",
        _staging_mode,
    )
    writer: Writer = _option(
        "process",
        '"process": the save runs in a writer process of its own, started once and reused, reading the '
        'staged state from shared memory; "thread": in a thread of the calling process. A state the writer '
        "process cannot take (jax arrays, CUDA tensors, lazy sources, a memory:// location) is saved by the "
        "thread.",
        _writer,
    )


@dataclasses.dataclass(frozen=True)
class RestoreOptions(_Options):
    """How a checkpoint is read: the options of every verb that reads one."""

    strict: bool = _option(
        True,
        "Raise when the target and the checkpoint have different leaves (False: restore the common ones; "
        "a target with none in common still raises).",
        _flag,
    )
    inplace: bool = _option(
        False,
        "Copy straight into the target's tensors and arrays (a meta-device target, which has no memory, "
        "gets a new tensor in the result).",
        _flag,
    )
    as_saved: bool = _option(False, "Without a target: give each array back as the kind it was saved as.", _flag)
    group: Any = _option(
        None, "The torch.distributed process group whose ranks restore together (default: the default group)."
    )
    timeout: datetime.timedelta | None = _option(None, "Bound on every wait on other ranks.", _timeout)
    progress: bool | None = _option(
        None, "A bar of bytes read on rank 0 (None: when stderr is a terminal).", _bar
    )
    max_inflight_bytes: int = _option(
        READ_WINDOW_BYTES,
        "Reads in flight: the memory a restore needs beyond its result (smaller: less memory, less overlap).",
        _window,
    )
    casting: str = _option(
        "same_kind",
        'numpy\'s rule for a target of another dtype ("no", "equiv", "safe", "same_kind", "unsafe"); '
        '"same_kind" also refuses values that do not fit.',
        _casting,
    )
    format: str | None = _option(
        None,
        'The checkpoint\'s format: "tsckpt", "safetensors" (a file or a Hugging Face directory), "torch" '
        '(a torch.save file), "dcp" or "orbax"; None detects it from its files, as convert does.',
        _format,
    )
    allow_pickle: bool = _option(
        False,
        "Read a checkpoint whose metadata is a Python pickle (a torch.distributed.checkpoint directory); "
        "unpickling can run arbitrary code: only for a checkpoint from a trusted source.",
        _flag,
    )
    mapping: Rules | None = _option(
        None,
        "Rules from stored leaves to target leaves (renames; transposes, reshapes, splits and joins of "
        "arrays), applied as the data is read: tsckpt.mappings (docs/mapping.md).",
        _rules,
    )
    copy: Copy = _option(
        True,
        "True: every array in new memory (the safe default). False: a leaf whose region is exactly one stored "
        "chunk, stored raw in a local file (tsckpt's one-chunk files, safetensors tensors), maps the file's bytes "
        "instead of copying them: copy-on-write (MAP_PRIVATE), so writing it changes only this process's pages, "
        f"never the file; each chunk's crc32c is checked before anything is returned. {READ_ONLY!r}: so, with "
        "numpy arrays read-only. A mapped array reads the file as it is: a file truncated while mapped kills the "
        "process with SIGBUS when a lost page is touched, one rewritten in place shows its new bytes in pages not "
        "yet written; one replaced (renamed over) or deleted leaves the mapping intact. Leaves mapping cannot serve "
        "(a cast, a resharded region, inner chunks, compressed or other formats' data, object storage, in-place "
        "targets) are copied, and the tsckpt logger says which and why (docs/zerocopy.md).",
        _copy,
    )


def timeout_seconds(timeout: datetime.timedelta | float | None) -> float | None:
    """``timeout`` in seconds: a timedelta, as every verb takes, or float seconds, as
    :class:`concurrent.futures.Future` takes; None waits without bound."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"timeout must be a datetime.timedelta, float seconds or None, not {timeout!r} ({type(timeout).__name__})"
        )
    return float(timeout)


# ---- which verb takes which options -----------------------------------------------------

_AT_CONSTRUCTION = "given to CheckpointManager(...) once: the same for every step of the run"
_PER_CALL = "an option of each save/save_async/restore call, not of the manager"
_ONE_PROCESS = "convert runs in one process, without torch.distributed"
_NO_TARGET = "convert has no target tree: it writes the selected leaves as the source stores them"
_OWN_STEPS = "a manager restores the steps it saved itself: tsckpt checkpoints, never another format"
_NO_READ = "it reads no array data into a target (metadata only, or one lazy read at a time)"
_LAZY = "it returns a lazy view: each read asks for what it needs, nothing is restored in one go"
_DCP_PLANS = (
    "dcp.load plans and coordinates the load (its planner matches keys: DefaultLoadPlanner(allow_partial_load=True) "
    "loads the common ones); each rank reads its items alone"
)
_DCP_BASE = "dcp.save names no previous checkpoint; save with tsckpt.save(..., base=...) or a CheckpointManager"
_ONE_READER = "it reads in one process, without torch.distributed"
_OWN_NAMES = "it restores what tsckpt.torch.save wrote into the same objects: the names and layouts match"
_MANAGER_BASE = "a manager's base is its latest complete step (incremental=False: none)"
# open, metadata and verify read a checkpoint without a target: only the options that say
# which checkpoint and how to open it apply
_NO_TARGET_READ = {
    "strict": "it has no target tree to compare with the checkpoint",
    "inplace": "it has no target tree to copy into",
    "as_saved": "it builds no restored tree",
    "casting": "it has no target dtype to cast into",
    "group": _ONE_READER,
    "timeout": _ONE_READER,
}

# Verb -> {option set: {option of that set the verb does not take: why}}. A verb takes
# every other option of its sets, with the set's name, default and annotation.
VERBS: dict[str, dict[type[_Options], dict[str, str]]] = {
    "tsckpt.save": {SaveOptions: {}},
    "tsckpt.save_async": {SaveOptions: {}, AsyncOptions: {}},
    "tsckpt.torch.save": {SaveOptions: {}},
    "tsckpt.torch.save_async": {SaveOptions: {}, AsyncOptions: {}},
    "CheckpointManager": {
        SaveOptions: {"overwrite": _PER_CALL, "max_inflight_bytes": _PER_CALL, "progress": _PER_CALL,
                      "base": _MANAGER_BASE},
        AsyncOptions: {},
        RestoreOptions: {
            "strict": _PER_CALL, "inplace": _PER_CALL, "as_saved": _PER_CALL, "progress": _PER_CALL,
            "max_inflight_bytes": _PER_CALL, "casting": _PER_CALL, "format": _OWN_STEPS, "allow_pickle": _OWN_STEPS,
            "mapping": _PER_CALL, "copy": _PER_CALL,
        },
    },
    "CheckpointManager.save": {
        SaveOptions: {"group": _AT_CONSTRUCTION, "check_replicas": _AT_CONSTRUCTION, "timeout": _AT_CONSTRUCTION,
                      "layout": _AT_CONSTRUCTION, "inner_chunks": _AT_CONSTRUCTION, "incremental": _AT_CONSTRUCTION,
                      "base": _MANAGER_BASE},
        AsyncOptions: {"if_busy": _AT_CONSTRUCTION, "max_staging_bytes": _AT_CONSTRUCTION, "staging": _AT_CONSTRUCTION,
                       "writer": _AT_CONSTRUCTION},
    },
    "CheckpointManager.save_async": {
        SaveOptions: {"group": _AT_CONSTRUCTION, "check_replicas": _AT_CONSTRUCTION, "timeout": _AT_CONSTRUCTION,
                      "layout": _AT_CONSTRUCTION, "inner_chunks": _AT_CONSTRUCTION, "incremental": _AT_CONSTRUCTION,
                      "base": _MANAGER_BASE},
        AsyncOptions: {"if_busy": _AT_CONSTRUCTION, "max_staging_bytes": _AT_CONSTRUCTION, "staging": _AT_CONSTRUCTION,
                       "writer": _AT_CONSTRUCTION},
    },
    "tsckpt.restore": {RestoreOptions: {}},
    "CheckpointManager.restore": {
        RestoreOptions: {
            "group": _AT_CONSTRUCTION, "timeout": _AT_CONSTRUCTION, "format": _OWN_STEPS, "allow_pickle": _OWN_STEPS,
        },
    },
    "tsckpt.torch.restore": {
        RestoreOptions: {
            "inplace": "always in place: it restores into the live model, optimizers and objects",
            "as_saved": "it restores into a live model, never a tree of the saved kinds",
            "format": "it restores what tsckpt.torch.save wrote (model, optimizers, RNG, extras): a tsckpt checkpoint",
            "allow_pickle": "it restores what tsckpt.torch.save wrote: a tsckpt checkpoint, never a pickle",
            "mapping": _OWN_NAMES,
        },
    },
    "tsckpt.torch.StorageWriter": {SaveOptions: {"base": _DCP_BASE}},
    "tsckpt.torch.StorageReader": {
        RestoreOptions: {
            "strict": _DCP_PLANS, "inplace": "always in place: DCP's planner gives the state dict's tensors to read into",
            "as_saved": "it loads into the state dict DCP gives, never a tree of the saved kinds",
            "group": _DCP_PLANS, "timeout": _DCP_PLANS,
            "mapping": "DCP's planner matches the state dict's keys to the stored ones; map with tsckpt.restore",
            "copy": "DCP's planner gives the state dict's tensors to read into: always a copy",
        },
    },
    "tsckpt.open": {RestoreOptions: {**_NO_TARGET_READ, "progress": _LAZY, "max_inflight_bytes": _LAZY}},
    "tsckpt.metadata": {
        RestoreOptions: {**_NO_TARGET_READ, "progress": _NO_READ, "max_inflight_bytes": _NO_READ, "copy": _NO_READ},
    },
    "tsckpt.verify": {
        RestoreOptions: {
            **_NO_TARGET_READ,
            "max_inflight_bytes": "verify keeps its own window of reads in flight (256 MiB): it holds no result",
            "mapping": "it checks the stored arrays as they are stored",
            "copy": "it returns no arrays: it only checks them",
        },
    },
    "tsckpt.diff": {
        RestoreOptions: {
            **_NO_TARGET_READ,
            "format": "diff detects each side's format from its files: the two may differ",
            "mapping": "diff compares the stored leaves as stored; map one side first with convert(mapping=...)",
            "copy": "it returns no arrays: it compares them block by block",
        },
    },
    "tsckpt.convert": {
        SaveOptions: {
            "group": _ONE_PROCESS, "check_replicas": _ONE_PROCESS, "timeout": _ONE_PROCESS,
            "max_inflight_bytes": "convert's window is the read side's (RestoreOptions): it bounds the source "
            "data read and not yet written",
            "base": "convert writes a checkpoint from another format: there is no tsckpt step to share with",
            "incremental": "convert writes every file (with content hashes, so a later save may share them)",
        },
        RestoreOptions: {
            "group": _ONE_PROCESS, "timeout": _ONE_PROCESS, "strict": _NO_TARGET, "inplace": _NO_TARGET,
            "as_saved": _NO_TARGET,
            "format": "convert names its source's format from_format, beside the destination's to_format",
            "copy": "convert writes what it reads to another checkpoint; it returns no arrays",
        },
    },
}


def signature_problems(fn: Callable[..., Any], name: str) -> list[str]:
    """How the signature of ``fn``, the verb ``name`` of :data:`VERBS`, differs from its options."""
    if name not in VERBS:
        return [f"{name!r} is not a verb of tsckpt/_options.py VERBS"]
    params = inspect.signature(fn).parameters
    problems: list[str] = []
    wanted: set[str] = set()
    reasons: dict[str, str] = {}
    for options, not_taken in VERBS[name].items():
        fields = {f.name: f for f in dataclasses.fields(options)}
        hints = typing.get_type_hints(options)
        problems += [f"VERBS lists {o!r}, which is no option of {options.__name__}" for o in not_taken if o not in fields]
        reasons.update(not_taken)
        for option, f in fields.items():
            if option in not_taken:
                continue
            wanted.add(option)
            problems += _parameter_problems(fn, params.get(option), options, f, hints[option])
    for option in sorted(reasons.keys() - wanted):
        if option in params:
            problems.append(f"takes {option!r}, which makes no sense there ({reasons[option]})")
    return problems


def _parameter_problems(
    fn: Callable[..., Any], p: inspect.Parameter | None, options: type[_Options], f: dataclasses.Field[Any], hint: Any
) -> list[str]:
    where = f"{options.__name__}.{f.name}"
    if p is None:
        return [f"lacks the option {f.name!r} ({where})"]
    if p.kind is not inspect.Parameter.KEYWORD_ONLY:
        return [f"takes {f.name!r} positionally; options are keyword-only (put it after '*')"]
    problems = []
    if type(p.default) is not type(f.default) or p.default != f.default:
        problems.append(f"{f.name!r} defaults to {p.default!r}, not {f.default!r} as {where}")
    annotation = p.annotation
    if isinstance(annotation, str):
        try:
            annotation = eval(annotation, fn.__globals__)  # noqa: S307 - the verb's own annotation text
        except Exception as e:  # noqa: BLE001 - reported as a problem of the signature
            return problems + [f"{f.name!r} has an annotation that cannot be evaluated ({p.annotation}: {e})"]
    if annotation != hint:
        problems.append(f"{f.name!r} is annotated {p.annotation}, not {f.type} as {where}")
    return problems


def verb(name: str) -> Callable[[_F], _F]:
    """Declare ``fn`` the verb ``name`` of :data:`VERBS`: every call first passes the fork
    check (a child forked after tsckpt ran refuses). That its signature agrees with its
    options (:func:`signature_problems`) is checked by the tests, not at every import."""

    def declare(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            _fork.enter(name)
            return fn(*args, **kwargs)

        return typing.cast(_F, call)

    return declare
