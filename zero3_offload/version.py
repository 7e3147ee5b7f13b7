"""The package version (read by the checkpoint metadata and ``zero3_offload.__version__``)."""

__version__ = "0.1.0"
