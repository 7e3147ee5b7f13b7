"""Every example of a record source, with the bad-record policy applied."""

from __future__ import annotations

from collections.abc import Mapping

from zero3_offload.data.bad_record import BadRecord
from zero3_offload.data.bad_records import BadRecords
from zero3_offload.data.example import Example
from zero3_offload.data.readers import Unreadable, iter_records
from zero3_offload.data.record_format import RecordFormat
from zero3_offload.data.source import DataSource
from zero3_offload.errors import InputError

__all__ = ["load_examples"]


def load_examples(
    source: DataSource, *, data_format: str, data_field: str | None, bad: BadRecords
) -> list[Example]:
    """The examples of ``source`` in file order (files sorted by path).

    The format is ``data_format``, or detected from the first record that is an
    object. Bad records go to ``bad`` (which raises, or counts them).

    Raises:
        InputError: a file that cannot be read, no recognisable shape, a bad record
            under the ``fail`` policy, or no usable example at all.
    """
    form: RecordFormat | None = None
    examples: list[Example] = []
    seen = 0
    for record, where in iter_records(source):
        seen += 1
        if isinstance(record, Unreadable):
            bad.bad(where, record.reason)
            continue
        if form is None and (isinstance(record, Mapping) or data_format != "auto"):
            form = RecordFormat.detect(
                record, where, data_format=data_format, data_field=data_field
            )
        if form is None:
            bad.bad(where, f"the record is a {type(record).__name__}, not an object")
            continue
        try:
            examples.append(form.example(record, where))
        except BadRecord as exc:
            bad.bad(exc.where, exc.reason)
    if not examples:
        detail = f"; {bad.skipped} bad record(s) skipped, the first: {bad.first}" if seen else ""
        raise InputError(f"{source.path}: no usable example in {seen} record(s){detail}")
    return examples
