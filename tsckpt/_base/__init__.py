"""Foundations every layer uses: plain data types, dtypes and the casting rules, and
JAX's pytree registry for :mod:`tsckpt.tree`.

Owns:

- :mod:`.types`: ``ShardedArray`` (and ``TorchRegion``), ``ArraySpec``, ``LazySource``,
  the descriptor ``LeafDesc``, ``ReadItem``, a region (``Box``).
- :mod:`.dtypes`: dtype names, storage dtypes, itemsizes, zero-copy torch/numpy views.
- :mod:`.casting`: each dtype's place in the ``casting=`` order, which casts a policy
  allows, and the check of the values a cast would lose.
- :mod:`.jaxtree`: JAX's pytree registry when jax is imported.
- :mod:`.lazytorch`: torch imported only when a torch object is involved, and the type
  tests (tensor, dtype, generator) that never import it.
- :mod:`.leafnames`: leaf paths as people type them (``/`` and ``.`` alike, a path or glob
  selecting the leaves at or below it) and what to suggest for a name that selects none.
- :mod:`.mapping`: transforms on read: ``Rule``, ``Rules`` and the views, their resolution
  against stored leaves, and the planner of each target region's stored boxes.

May import: :mod:`tsckpt._errors` only.
"""
