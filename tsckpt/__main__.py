"""``python -m tsckpt``: the same command line as the ``tsckpt`` script."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
