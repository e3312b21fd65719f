"""Other libraries' checkpoint formats: which one a location holds, and each one's reader.

Owns:

- :mod:`.sources`: the one place that tells a checkpoint's format (``detect``) and opens
  it for the read verbs (``open_checkpoint``), whatever the format.
- :mod:`.lazy`: another library's checkpoint as a ``Checkpoint`` of lazy sources (ties
  stored once), and the one way to read a region of such an array.
- :mod:`.safetensors`: safetensors files and Hugging Face directories, headers and
  indexes checked field by field, read and written in blocks.
- :mod:`.torchfile`: ``torch.save`` files, loaded with ``weights_only=True``.
- :mod:`.torchdir`: Hugging Face directories of ``torch.save`` files (``pytorch_model.bin``,
  or shards and ``pytorch_model.bin.index.json``), each file read as :mod:`.torchfile` reads it.
- :mod:`.dcp`: torch.distributed.checkpoint directories (pickled metadata only with
  ``allow_pickle``), and nesting DCP's flat keys by its key paths (``nest``), which
  tsckpt's DCP storage writer also uses.
- :mod:`.orbax`: Orbax item and step directories, through TensorStore alone.

Each format module knows only its own marker files and reads only its own format;
``convert`` (one layer up) streams any of them into tsckpt or safetensors.

May import: :mod:`tsckpt._leaves`, :mod:`tsckpt._ondisk` and the packages below them;
never the verbs (``_read``, ``_save``) or anything above.
"""
