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

from collections.abc import Iterable

from ._base.mapping import Concat, MappingError, Reshape, Rule, Rules, Split, Transpose

__all__ = ["Concat", "MappingError", "Reshape", "Rule", "Rules", "Split", "Transpose", "flax_to_torch", "torch_to_flax"]

# Flax's convolution kernel is (*spatial, in, out), torch's weight (out, in, *spatial): the
# permutation that gives torch's from Flax's, by number of dimensions
_CONV_TO_TORCH = {3: (2, 1, 0), 4: (3, 2, 0, 1), 5: (4, 3, 0, 1, 2)}
_CONV_TO_FLAX = {3: (2, 1, 0), 4: (2, 3, 1, 0), 5: (2, 3, 4, 1, 0)}
_SAME = (("embedding", "weight"), ("scale", "weight"), ("bias", "bias"), ("mean", "running_mean"), ("var", "running_var"))
_FLAX_TO_TORCH = ("/", ".")


def flax_to_torch(*, stored_prefix: str = "", target_prefix: str = "") -> Rules:
    """Rules that restore a Flax model's parameters (NNX ``nnx.state(model)``, or a Linen
    ``params`` tree under ``stored_prefix="params/"``) into a torch module's state dict:
    ``{m}/kernel`` -> ``{m}.weight`` transposed, and the rest of the table above."""
    s, t = stored_prefix, target_prefix
    rules = [Rule(f"{s}{{m*}}/kernel", f"{t}{{m*}}.weight", Transpose((1, 0)), sep=_FLAX_TO_TORCH, ndim=2)]
    rules += [
        Rule(f"{s}{{m*}}/kernel", f"{t}{{m*}}.weight", Transpose(perm), sep=_FLAX_TO_TORCH, ndim=n)
        for n, perm in _CONV_TO_TORCH.items()
    ]
    rules += [Rule(f"{s}{{m*}}/{flax}", f"{t}{{m*}}.{torch}", sep=_FLAX_TO_TORCH) for flax, torch in _SAME]
    return Rules(rules)


def torch_to_flax(*, embeddings: Iterable[str] = (), stored_prefix: str = "", target_prefix: str = "") -> Rules:
    """Rules that restore a torch module's state dict into a Flax model's parameters (the
    tree of ``nnx.state(model)``, or Linen ``params`` with ``target_prefix="params/"``): the
    table above read right to left. ``embeddings``: the names of the Embedding modules
    (``"wte"``, ``"blocks.0.embed"``), whose 2-D weights are not transposed."""
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
    return Rules(rules)
