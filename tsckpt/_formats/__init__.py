"""Checkpoint formats: which one a location holds, each one's reader, and convert.

``sources`` is the one place that tells a checkpoint's format (:func:`sources.detect`)
and opens it: :func:`sources.open_checkpoint` as a ``Checkpoint`` for the read verbs,
:func:`sources.open_source` as a tree of lazy sources for convert. Each format module
(``orbax``, ``safetensors``, ``torchfile``, ``dcp``) knows only its own marker files
and reads only its own format; ``convert`` streams a source into tsckpt or safetensors.
"""
