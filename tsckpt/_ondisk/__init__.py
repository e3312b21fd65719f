"""What a checkpoint is on disk: tsckpt's records and nodes, and a checkpoint opened.

Owns:

- :mod:`.records`: the format version, node JSON, array records, plain-value encoding.
- :mod:`.arrays`: where arrays live per layout (files, or the compact layout's OCDBT
  databases), an array's ``zarr.json``, opening an array through TensorStore.
- :mod:`.chunking`: chunk and shard shapes of one array; a region's pieces in the grid.
- :mod:`.root`: the root ``zarr.json``: the one reading of its state, parsed and
  validated into a ``Checkpoint``.
- :mod:`.checkpoint`: the opened checkpoint of any format (``Checkpoint``) and opening
  one of its arrays.
- :mod:`.backing`: whether the shard files a read touches hold the bytes their records
  give them, probed before anything is allocated.
- :mod:`.readfaults`: what a failed read of an array means, in the words every read
  path uses.
- :mod:`.stepindex`: a manager's step index on object stores (one marker per step).
- :mod:`.bounds`: metadata files read within bounds: never a FIFO, a device or a file
  larger than the limit of its kind.

May import: :mod:`tsckpt._runtime`, :mod:`tsckpt._storage`, ``tree`` and the foundations.
"""
