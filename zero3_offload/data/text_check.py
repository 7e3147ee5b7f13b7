"""Refusing what is not text where text is expected (``--data`` of a text file)."""

from __future__ import annotations

import codecs
from pathlib import Path

from zero3_offload.errors import InputError

__all__ = ["check_text"]

# The first bytes of binary formats a user may name as text, and what they are.
_MAGIC = {
    b"PAR1": "a Parquet file: name it *.parquet to read its records",
    b"\x89HDF": "an HDF5 file",
    b"PK\x03\x04": "a zip archive",
    b"\x1f\x8b": "a gzip file",
    b"ARROW1": "an Arrow file",
    b"\x7fELF": "an executable",
}


def check_text(path: Path, data: bytes, *, complete: bool) -> None:
    """Check that ``data``, read from ``path``, is UTF-8 text without NUL bytes.

    Args:
        path: the file, for the message.
        data: its bytes (or the first of them).
        complete: False when ``data`` was cut at a size limit, so a character split
            at the end is not an error.

    Raises:
        InputError: one line naming ``path``, the byte offset, and the format when its
            first bytes are those of a known binary format.
    """
    for magic, what in _MAGIC.items():
        if data.startswith(magic):
            raise InputError(f"{path}: not text: it is {what}")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise InputError(f"{path}: not text: a NUL byte at offset {nul} (a binary file?)")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=complete)
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path}: not UTF-8 text: invalid byte at offset {exc.start} (a binary file?)"
        ) from None
