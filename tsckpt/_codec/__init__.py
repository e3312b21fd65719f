"""tsckpt's own zarr v3 codec: the chunk and shard files of tsckpt's format, read and
written without TensorStore where that is faster, byte for byte as TensorStore does.

Owns:

- :mod:`.route`: the one rule saying which arrays the own codec handles (both directions),
  and the switch ``TSCKPT_CODEC=tensorstore`` that sends all I/O through TensorStore.
- :mod:`.crc`: crc32c through the crc32c package's public API (the GIL released).
- :mod:`.contenthash`: the xxh3-128 content hash of a file's data (incremental saves' proof), and of
  each inner chunk of a shard file (what lets diff read only the inner chunks that differ).
- :mod:`.files`: an array's stored shapes, and the shard index (:class:`.files.ShardIndex`).
- :mod:`.encode`: unsharded chunk files (one kvstore read or write each).
- :mod:`.chunkread`: restore's reads of unsharded chunk files into CPU memory.
- :mod:`.chunkmap`: zero-copy reads: a region that is exactly one unsharded chunk file, as
  a view of the file's private mapping, its crc32c checked through it.
- :mod:`.shardwrite`, :mod:`.shardread`: shard files of a local plain checkpoint, by
  positional I/O (direct I/O where the file system has it); shardread also gives a shard's
  inner chunks as stored, for diff's chunk-by-chunk comparison.
- :mod:`.pagecache`: how much of a file the page cache holds; switching direct I/O on.
- :mod:`.threads`: the I/O worker pool, which keeps working while the interpreter exits.

May import: :mod:`tsckpt._ondisk`, :mod:`tsckpt._runtime`, :mod:`tsckpt._storage` and the
foundations; never :mod:`tsckpt._leaves` or :mod:`tsckpt._coord` (its neighbours in the
layer) or anything above.
"""
