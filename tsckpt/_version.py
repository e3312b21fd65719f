"""The library version, in one place (the package, the CLI and every root record name it)."""

__version__ = "0.1.0"
