"""What ``--data`` names: text, files of records, or a ``datasets`` directory.

* A file named ``*.jsonl``, ``*.json``, ``*.parquet`` or ``*.csv`` holds records.
* A directory that ``datasets.Dataset.save_to_disk`` (or ``DatasetDict``'s) wrote
  (``dataset_info.json``, ``state.json`` or ``dataset_dict.json`` in it) is a dataset.
* A directory of record files holds records (all its files, sorted by path; a
  directory that mixes record files with other files is refused).
* Anything else is text (today's byte stream), checked to be UTF-8 by ``text_check``.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from zero3_offload.errors import InputError

__all__ = ["RECORD_SUFFIXES", "DataSource", "find_source"]

RECORD_SUFFIXES = frozenset({".jsonl", ".json", ".parquet", ".csv"})
"""File name endings read as records rather than text."""
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@attrs.frozen
class DataSource:
    """A resolved ``--data``: its kind and the files to read, sorted by path."""

    path: Path
    kind: str  # "text", "records" or "datasets"
    files: tuple[Path, ...]

    @property
    def structured(self) -> bool:
        """True for examples (records or a dataset) rather than a text stream."""
        return self.kind != "text"


def _visible(root: Path) -> list[Path]:
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def find_source(path: str | Path) -> DataSource:
    """Resolve ``path`` (see the module docstring).

    Raises:
        InputError: when it does not exist, holds no file, or mixes record files with
            other files.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if path.is_dir():
        if any((path / marker).is_file() for marker in _DATASET_MARKERS):
            return DataSource(path, "datasets", (path,))
        files = _visible(path)
        if not files:
            raise InputError(f"{path}: the directory holds no file")
        records = [p for p in files if p.suffix.lower() in RECORD_SUFFIXES]
        if records and len(records) != len(files):
            other = next(p for p in files if p.suffix.lower() not in RECORD_SUFFIXES)
            raise InputError(
                f"{path}: mixes record files ({records[0].name}) with other files "
                f"({other.name}): give a directory of one kind"
            )
        return DataSource(path, "records" if records else "text", tuple(files))
    kind = "records" if path.suffix.lower() in RECORD_SUFFIXES else "text"
    return DataSource(path, kind, (path,))
