"""Leaf paths as people type them: ``/`` and ``.`` alike between their parts (tsckpt joins keys
with ``/``; Hugging Face names hold dots inside one key), a path or glob selecting the leaves
at or below it, and what to suggest for a name that selects none. One definition for every
command and verb that takes leaf names (ls, show, diff)."""

from __future__ import annotations

import difflib
import fnmatch
import shlex
from collections.abc import Sequence


def spelled(path: str) -> str:
    """``path`` with its separators written alike (``/`` as ``.``)."""
    return path.replace("/", ".")


def under(path: str, prefix: str | None) -> bool:
    """Whether the leaf ``path`` is ``prefix`` or below it, ``/`` and ``.`` both separating
    components (``model.layers.0`` holds ``model/layers/0/w`` and ``model.layers.0.mlp.weight``,
    not ``model.layers.01``); ``prefix`` may be a glob (``fnmatch``, case-sensitive:
    ``model/*``, ``model.layers.[0-3]``), matching the path or a part of it above the leaf.
    No prefix (or an empty one) holds every leaf."""
    want = spelled(prefix or "").strip(".")
    if not want:
        return True
    have = spelled(path)
    if have == want or have.startswith(want + "."):
        return True
    return fnmatch.fnmatchcase(have, want) or fnmatch.fnmatchcase(have, want + ".*")


def listed(paths: Sequence[str], limit: int = 10) -> str:
    """``paths`` quoted, the first ``limit`` of them and how many more."""
    shown = ", ".join(f"'{p}'" for p in paths[:limit]) or "none"
    return shown + (f", ... {len(paths) - limit} more" if len(paths) > limit else "")


def _or_list(names: list[str]) -> str:
    quoted = [f"'{n}'" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def did_you_mean(name: str, leaves: Sequence[str], directory: str, *, prefixes: bool = False) -> str:
    """What to say after "no leaf ``name``": the leaf paths (and, with ``prefixes``, the
    prefixes of them ls takes), ``/`` and ``.`` alike, that hold it (the shortest three, none
    below another), else the closest to it (difflib); else how to list them all."""
    want = spelled(name).strip(".")
    shown: dict[str, str] = {}  # spelled -> as ls writes it (the spelling keeps every position)
    for p in leaves:
        spelt = spelled(p)
        shown.setdefault(spelt, p)
        if prefixes:
            for i, ch in enumerate(spelt):
                if ch == ".":
                    shown.setdefault(spelt[:i], p[:i])
    holding: list[str] = []  # the shortest first, none below another
    for c in sorted((c for c in shown if want and want in c), key=lambda c: (len(c), c)):
        if len(holding) < 3 and not any(c.startswith(h + ".") for h in holding):
            holding.append(c)
    picked = [shown[c] for c in holding]
    if not picked:
        close = difflib.get_close_matches(want, list(shown), n=10, cutoff=0.6)
        scores = [difflib.SequenceMatcher(None, want, c).ratio() for c in close]
        picked = [shown[c] for c, score in zip(close, scores) if score >= max(scores) - 0.05][:3]
    if picked:
        return f"did you mean {_or_list(picked)}?"
    return f"`tsckpt ls {shlex.quote(directory)}` lists every leaf"
