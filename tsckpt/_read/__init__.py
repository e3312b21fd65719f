"""Reading: the read verbs over a checkpoint of any format.

Owns:

- :mod:`.open`: ``open`` and ``metadata``: a checkpoint as a lazy ``Reader``.
- :mod:`.reader`: lazy reads of an opened checkpoint: ``LazyArray``, the ``Reader``
  mapping, index normalisation, ``read_subtree``.
- :mod:`.mapped`: a checkpoint seen through a mapping's rules (target leaves, the reads
  that fill each target region), and its lazy ``Reader``.
- :mod:`.restore`: ``restore``: matching a target to a checkpoint, its destinations made
  (fresh, in place, meta targets materialised) and checked.
- :mod:`.engine`: the read engine: each destination's reader planned (the own codec's
  tiers, other formats' sources, TensorStore) and the reads executed within the window.
- :mod:`.zerocopy`: ``copy=False``: leaves mapped from their files where a stored chunk is
  exactly the region (own chunk files, safetensors tensors), the rest copied and logged.
- :mod:`.verify`: ``verify``: node checks and a windowed read of every chunk.
- :mod:`.diff`: ``diff``: two checkpoints compared leaf by leaf, block by block within the
  window, regions known equal from what is stored not read.

May import: :mod:`tsckpt._options`, :mod:`tsckpt._formats` and the packages below them;
never :mod:`tsckpt._save` (a sibling) or anything above.
"""
