"""Transforms on read: rules that map a checkpoint's stored leaves to a target's leaves.

Pass ``mapping=`` to :func:`tsckpt.restore`, :func:`tsckpt.open` or :func:`tsckpt.metadata`
(and ``tsckpt ls --map``): a :class:`Rules` of :class:`Rule` objects, or one of the
ready-made sets below for the usual Flax <-> PyTorch pairs. See docs/mapping.md.

The ready-made sets map, module by module (``{m}`` is the module's path; Flax's ``/``
become torch's ``.`` and back):

==================================  ================================  ===========================
Flax (NNX or Linen)                 torch                             view
==================================  ================================  ===========================
``{m}/kernel`` (2-D, Dense/Linear)  ``{m}.weight`` (Linear)           transposed
``{m}/kernel`` (3-D, 4-D, 5-D Conv) ``{m}.weight`` (Conv1d/2d/3d)     (..., in, out) <-> (out, in, ...)
``{m}/embedding`` (Embed)           ``{m}.weight`` (Embedding)        as stored
``{m}/scale`` (LayerNorm, RMSNorm)  ``{m}.weight`` (1-D)              as stored
``{m}/bias``                        ``{m}.bias``                      as stored
``{m}/mean``, ``{m}/var`` (BatchNorm) ``{m}.running_mean``, ``.running_var``  as stored
==================================  ================================  ===========================

torch does not tell an Embedding's 2-D weight from a Linear's: :func:`torch_to_flax` takes
the Embedding modules' names (``embeddings=("embed",)``). A Flax 3-D kernel is taken for a
Conv1d (a ``DenseGeneral`` or attention kernel needs rules of its own: :class:`Reshape`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from ._base.mapping import Concat, MappingError, Reshape, Rule, Rules, Split, Transpose

__all__ = [
    "Concat", "MappingError", "Reshape", "Rule", "Rules", "Split", "Transpose", "flax_to_torch", "load", "torch_to_flax",
]

# Flax's convolution kernel is (*spatial, in, out), torch's weight (out, in, *spatial): the
# permutation that gives torch's from Flax's, by number of dimensions
_CONV_TO_TORCH = {3: (2, 1, 0), 4: (3, 2, 0, 1), 5: (4, 3, 0, 1, 2)}
_CONV_TO_FLAX = {3: (2, 1, 0), 4: (2, 3, 1, 0), 5: (2, 3, 4, 1, 0)}
_SAME = (("embedding", "weight"), ("scale", "weight"), ("bias", "bias"), ("mean", "running_mean"), ("var", "running_var"))
_FLAX_TO_TORCH = ("/", ".")
# A Flax leaf as tsckpt names it (``l1/kernel``), and as Orbax stores an NNX Variable
# (``l1/kernel/value``): the ready-made rules match both.
_VALUE_LEVELS = ("", "/value")


def flax_to_torch(*, stored_prefix: str = "", target_prefix: str = "", unmatched: str = "keep") -> Rules:
    """Rules that restore a Flax model's parameters (NNX ``nnx.state(model)``, or a Linen
    ``params`` tree under ``stored_prefix="params/"``) into a torch module's state dict:
    ``{m}/kernel`` -> ``{m}.weight`` transposed, and the rest of the table above. An NNX
    state Orbax wrote matches as well: its leaves' ``/value`` level (``l1/kernel/value``)
    is dropped, and a list's items (stored as the string keys ``"0"``, ``"1"``) are named
    by their digits (``layers.0.weight``).
    ``unmatched="drop"`` leaves out the stored leaves no rule claims (an optimizer's state
    beside the model's)."""
    s, t = stored_prefix, target_prefix
    rules = []
    for v in _VALUE_LEVELS:
        rules.append(Rule(f"{s}{{m*}}/kernel{v}", f"{t}{{m*}}.weight", Transpose((1, 0)), sep=_FLAX_TO_TORCH, ndim=2))
        rules += [
            Rule(f"{s}{{m*}}/kernel{v}", f"{t}{{m*}}.weight", Transpose(perm), sep=_FLAX_TO_TORCH, ndim=n)
            for n, perm in _CONV_TO_TORCH.items()
        ]
        rules += [Rule(f"{s}{{m*}}/{flax}{v}", f"{t}{{m*}}.{torch}", sep=_FLAX_TO_TORCH) for flax, torch in _SAME]
    return Rules(rules, unmatched=unmatched)


def torch_to_flax(
    *, embeddings: Iterable[str] = (), stored_prefix: str = "", target_prefix: str = "", unmatched: str = "keep"
) -> Rules:
    """Rules that restore a torch module's state dict into a Flax model's parameters (the
    tree of ``nnx.state(model)``, or Linen ``params`` with ``target_prefix="params/"``): the
    table above read right to left. ``embeddings``: the names of the Embedding modules
    (``"wte"``, ``"blocks.0.embed"``), whose 2-D weights are not transposed; ``unmatched`` as
    for :func:`flax_to_torch`."""
    s, t = stored_prefix, target_prefix
    back = (_FLAX_TO_TORCH[1], _FLAX_TO_TORCH[0])
    rules = [Rule(f"{s}{name}.weight", f"{t}{name.replace('.', '/')}/embedding", ndim=2) for name in embeddings]
    rules.append(Rule(f"{s}{{m*}}.weight", f"{t}{{m*}}/scale", sep=back, ndim=1))
    rules.append(Rule(f"{s}{{m*}}.weight", f"{t}{{m*}}/kernel", Transpose((1, 0)), sep=back, ndim=2))
    rules += [
        Rule(f"{s}{{m*}}.weight", f"{t}{{m*}}/kernel", Transpose(perm), sep=back, ndim=n)
        for n, perm in _CONV_TO_FLAX.items()
    ]
    rules += [
        Rule(f"{s}{{m*}}.{torch}", f"{t}{{m*}}/{flax}", sep=back) for flax, torch in _SAME if torch != "weight"
    ]
    return Rules(rules, unmatched=unmatched)


READY_MADE = {"flax-to-torch": flax_to_torch, "torch-to-flax": torch_to_flax}


def load(spec: str) -> Rules:
    """Rules named on a command line (``tsckpt ls --map``): a ready-made set by name
    (``flax-to-torch``, ``torch-to-flax``; ``flax-to-torch:params/`` reads the stored leaves
    under that prefix), or a JSON file of rules::

        {"rules": [{"stored": "params/{m*}/kernel", "target": "{m*}.weight",
                    "views": [{"transpose": [1, 0]}], "sep": ["/", "."], "ndim": 2}]}

    A view is ``{"transpose": perm}``, ``{"reshape": shape}``, ``{"split": {"axis": a,
    "parts": n or [sizes]}}`` or ``{"concat": {"axis": a}}``; several stored or target
    templates are lists; ``"dtype": "float32"`` casts. Raises ValueError naming what is wrong."""
    name, _, prefix = spec.partition(":")
    if name in READY_MADE:
        return READY_MADE[name](stored_prefix=prefix)
    if not os.path.isfile(spec):
        raise ValueError(f"--map {spec!r}: neither a ready-made set ({', '.join(READY_MADE)}) nor a JSON file of rules")
    with open(spec, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{spec}: not JSON ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("rules"), list):
        raise ValueError(f'{spec}: expected {{"rules": [...]}}, a list of rules')
    return Rules(_rule_of(spec, i, r) for i, r in enumerate(doc["rules"]))


_VIEWS: dict[str, Any] = {
    "transpose": lambda a: Transpose(tuple(a)),
    "reshape": lambda a: Reshape(tuple(a)),
    "split": lambda a: Split(a["axis"], a["parts"] if isinstance(a["parts"], int) else tuple(a["parts"])),
    "concat": lambda a: Concat(a["axis"]),
}


def _rule_of(spec: str, i: int, r: Any) -> Rule:
    where = f"{spec}: rule {i}"
    try:
        views = []
        for v in r.get("views", []):
            (name, arg), = v.items()
            views.append(_VIEWS[name](arg))
        sep = r.get("sep")
        return Rule(
            r["stored"] if isinstance(r["stored"], str) else tuple(r["stored"]),
            r["target"] if isinstance(r["target"], str) else tuple(r["target"]),
            tuple(views),
            sep=None if sep is None else (str(sep[0]), str(sep[1])),
            ndim=r.get("ndim"),
            dtype=r.get("dtype"),
        )
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ValueError(
            f"{where} ({json.dumps(r)[:200]}): {e!r}; a rule is {{\"stored\": ..., \"target\": ..., \"views\": "
            f"[{{{' | '.join(repr(n) for n in _VIEWS)}: ...}}], \"sep\": [from, to], \"ndim\": n, \"dtype\": name}}"
        ) from e
