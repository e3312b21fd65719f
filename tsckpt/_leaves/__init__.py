"""Leaves: one adapter per kind of leaf a tree may hold, and the registry that picks it.

Owns:

- :mod:`.registry`: ``kind_of``, ``describe``, ``destination``, ``memory``: the one way
  the verbs ask about a leaf, whatever its type.
- :mod:`.kinds`: the ``LeafKind`` adapter and the torch, numpy, ``ShardedArray``,
  ``ArraySpec`` and lazy-source kinds.
- :mod:`.dtensor`: DTensors (the only user of torch's private sharding helper).
- :mod:`.jaxarray`: ``jax.Array`` leaves, saved shard by shard and restored device slice
  by device slice; typed PRNG keys (jax is never imported by tsckpt itself).
- :mod:`.stateful`: objects with ``state_dict()``/``load_state_dict()`` anywhere in a tree.
- :mod:`.quantized`: torchao's quantized tensor subclasses (MX, NVFP4, float8) as groups of
  plain arrays and their metadata; unknown tensor subclasses refused (torchao is never imported).

May import: :mod:`tsckpt._ondisk`, :mod:`tsckpt._runtime`, :mod:`tsckpt._storage`,
``tree`` and the foundations.
"""
