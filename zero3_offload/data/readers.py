"""The raw records of a ``DataSource``, each with where it came from.

A record is what one line, array element or row holds (a dict for a well-formed
file); its location is ``FILE:LINE`` (JSONL, CSV) or ``FILE row N`` (JSON arrays,
Parquet, ``datasets``; 1-based). A line that is not JSON is yielded as a
:class:`Unreadable` record, so the bad-record policy decides about it; a file that
cannot be read at all (not UTF-8, not Parquet, not a dataset) raises ``InputError``.
``datasets`` and ``pyarrow`` are imported only when a Parquet file or a dataset
directory is read.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from zero3_offload.data.source import DataSource
from zero3_offload.data.text_check import check_text
from zero3_offload.errors import ConfigError, InputError
from zero3_offload.integrations.require import require_module

__all__ = ["Unreadable", "iter_records"]


@attrs.frozen
class Unreadable:
    """A record that could not be parsed (e.g. a JSONL line that is not JSON)."""

    reason: str


def _text(path: Path) -> str:
    data = path.read_bytes()
    check_text(path, data, complete=True)
    return data.decode("utf-8")


def _jsonl(path: Path, text: str) -> Iterator[tuple[Any, str]]:
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line), f"{path}:{number}"
        except json.JSONDecodeError as exc:
            yield Unreadable(f"not JSON ({exc.msg} at column {exc.colno})"), f"{path}:{number}"


def _json(path: Path) -> Iterator[tuple[Any, str]]:
    text = _text(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # JSON Lines named .json (as Dataset.to_json writes)
            yield from _jsonl(path, text)
            return
        raise InputError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), list):
        value = next(iter(value.values()))  # {"data": [...]}
    if not isinstance(value, list):
        raise InputError(
            f"{path}: holds a JSON {type(value).__name__}, not an array of records "
            "(or JSON Lines): no recognisable shape"
        )
    for number, record in enumerate(value, 1):
        yield record, f"{path} row {number}"


def _csv(path: Path) -> Iterator[tuple[Any, str]]:
    reader = csv.DictReader(io.StringIO(_text(path), newline=""))
    try:
        for row in reader:
            yield row, f"{path}:{reader.line_num}"
    except csv.Error as exc:
        raise InputError(f"{path}:{reader.line_num}: not CSV ({exc})") from None


def _parquet(path: Path) -> Iterator[tuple[Any, str]]:
    pq = require_module("pyarrow.parquet", f"reading {path}")
    try:
        table = pq.ParquetFile(str(path))
        number = 0
        for group in range(table.num_row_groups):
            for record in table.read_row_group(group).to_pylist():
                number += 1
                yield record, f"{path} row {number}"
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None


def _dataset(path: Path) -> Iterator[tuple[Any, str]]:
    datasets = require_module("datasets", f"reading the dataset directory {path}")
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError, KeyError) as exc:
        raise InputError(f"{path}: not a readable datasets directory ({exc})") from None
    where = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" in loaded:
            split = "train"
        elif len(splits) == 1:
            split = splits[0]
        else:
            raise InputError(
                f"{path}: a DatasetDict with splits {splits} and no 'train' split: save the "
                "split to train on alone"
            )
        loaded, where = loaded[split], f"{path}[{split}]"
    for number, record in enumerate(loaded, 1):
        yield record, f"{where} row {number}"


def iter_records(source: DataSource) -> Iterator[tuple[Any, str]]:
    """Every record of ``source`` with its location, file by file in sorted order.

    Raises:
        InputError: a file that cannot be read as what its name says, naming it.
        ConfigError: when Parquet or a dataset directory is read without the ``hf``
            extra (pyarrow, datasets) installed.
    """
    if not source.structured:
        raise ConfigError(f"{source.path}: text, not records")
    if source.kind == "datasets":
        yield from _dataset(source.path)
        return
    for path in source.files:
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _jsonl(path, _text(path))
        elif suffix == ".json":
            yield from _json(path)
        elif suffix == ".csv":
            yield from _csv(path)
        else:
            yield from _parquet(path)
