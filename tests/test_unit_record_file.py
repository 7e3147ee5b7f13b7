"""Unit tests of ``RecordFile``, ``record_offsets`` and ``aligned``: real files under tmp_path.

Buffers are anonymous mappings (page-aligned) and lengths multiples of 4096 bytes, as
``O_DIRECT`` needs where the filesystem takes it; elsewhere the file is buffered and
the same calls work.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_disk_tier import small_fs  # noqa: F401  # the 1 MiB tmpfs fixture

from zero3_offload.errors import DiskTierError
from zero3_offload.storage.record_file import ALIGN, RecordFile, aligned, record_offsets


@pytest.fixture
def files(tmp_path: Path) -> Iterator[Callable[..., RecordFile]]:
    """Makes record files under tmp_path (``f.bin`` unless named); closes them after."""
    made: list[RecordFile] = []

    def make(nbytes: int, name: str = "f.bin") -> RecordFile:
        made.append(RecordFile(tmp_path / name, nbytes, holds="test records"))
        return made[-1]

    yield make
    for file in made:
        file.close()


def page(fill: int, pages: int = 1) -> mmap.mmap:
    """A page-aligned buffer of ``pages`` pages of the byte ``fill``."""
    buffer = mmap.mmap(-1, pages * ALIGN)
    buffer.write(bytes([fill]) * (pages * ALIGN))
    return buffer


def test_aligned_rounds_up_to_a_multiple_of_4096() -> None:
    assert [aligned(n) for n in (0, 1, 4095, 4096, 4097, 3 * 4096)] == [
        0,
        4096,
        4096,
        4096,
        8192,
        3 * 4096,
    ], "rule: aligned(n) is n rounded up to a multiple of ALIGN"


def test_records_follow_one_another_in_their_given_order() -> None:
    offsets, end = record_offsets({"b": 8192, "a": 4096, "empty": 0, "c": 4096})
    assert offsets == {"b": 0, "a": 8192, "empty": 12288, "c": 12288}, (
        "rule: each record starts where the one before it ends, in the mapping's order"
    )
    assert end == 16384, "rule: the file's size is the records' bytes"
    assert record_offsets({}) == ({}, 0), "rule: no records make an empty file"


def test_the_file_is_created_and_allocated_in_full_at_construction(
    files: Callable[..., RecordFile],
) -> None:
    file = files(3 * ALIGN, "state.bin")
    path = file.path
    assert path.stat().st_size == 3 * ALIGN, "rule: the file has its size from the start"
    assert file.allocated_bytes() >= 3 * ALIGN, (
        "rule: the blocks are allocated at once, so a later write never meets a full disk"
    )
    assert file.reads == (0, 0.0, 0) and file.writes == (0, 0.0, 0), (
        "rule: a new file has counted nothing"
    )


def test_a_file_that_exists_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    path.write_bytes(b"another run's")
    with pytest.raises(DiskTierError, match=r"cannot create .*state\.bin"):
        RecordFile(path, ALIGN, holds="test records")
    assert path.read_bytes() == b"another run's", "rule: the file is created exclusively"


def test_what_is_written_at_an_offset_is_read_back_and_every_transfer_is_counted(
    files: Callable[..., RecordFile],
) -> None:
    file = files(3 * ALIGN)
    file.write(memoryview(page(7)), 0)
    file.write(memoryview(page(9, pages=2)), ALIGN)
    back = page(0, pages=2)
    file.read(memoryview(back), ALIGN)
    assert back[:] == bytes([9]) * (2 * ALIGN), "rule: a read returns what was written there"
    file.read(memoryview(back)[:ALIGN], 0)
    assert back[:ALIGN] == bytes([7]) * ALIGN, "rule: a read returns what was written there"
    assert (file.writes[0], file.writes[2]) == (2, 3 * ALIGN), (
        "rule: writes count their calls and bytes"
    )
    assert (file.reads[0], file.reads[2]) == (2, 3 * ALIGN), (
        "rule: reads count their calls and bytes"
    )
    assert file.reads[1] > 0 and file.writes[1] > 0, "rule: and the seconds they took"


def test_step_figures_are_the_transfers_since_the_previous_call(
    files: Callable[..., RecordFile],
) -> None:
    file = files(2 * ALIGN)
    file.write(memoryview(page(1, pages=2)), 0)
    first = file.step_figures()
    assert (first["write_bytes"], first["read_bytes"]) == (2 * ALIGN, 0), (
        "rule: step_figures gives the bytes moved since it was last called"
    )
    file.read(memoryview(page(0)), ALIGN)
    second = file.step_figures()
    assert (second["write_bytes"], second["read_bytes"]) == (0, ALIGN), (
        "rule: step_figures gives one step's bytes, not the run's"
    )
    assert second["write_seconds"] == 0 and second["read_seconds"] > 0, (
        "rule: a step without writes has no write seconds"
    )
    assert file.step_figures() == dict.fromkeys(second, 0), (
        "rule: a step without transfers has nothing to report"
    )


def test_a_read_past_the_end_stops_short_and_names_the_file(
    files: Callable[..., RecordFile],
) -> None:
    file = files(ALIGN)
    path = file.path
    with pytest.raises(
        DiskTierError, match=re.escape(f"read of {path} at byte {ALIGN} stopped short")
    ):
        file.read(memoryview(page(0)), ALIGN)
    os.truncate(path, 0)  # the file loses its contents under the reader
    with pytest.raises(DiskTierError, match=re.escape(f"read of {path} at byte 0 stopped short")):
        file.read(memoryview(page(0)), 0)


def test_transfers_from_several_threads_at_once_are_all_counted(
    files: Callable[..., RecordFile],
) -> None:
    threads = 8
    file = files(threads * ALIGN)
    back = [page(0) for _ in range(threads)]

    def work(k: int) -> None:
        file.write(memoryview(page(k + 1)), k * ALIGN)
        file.read(memoryview(back[k]), k * ALIGN)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert [b[:] == bytes([k + 1]) * ALIGN for k, b in enumerate(back)] == [True] * threads, (
        "rule: each thread reads back what it wrote"
    )
    assert (file.writes[0], file.writes[2]) == (threads, threads * ALIGN), (
        "rule: transfers in several threads at once are each counted"
    )
    assert (file.reads[0], file.reads[2]) == (threads, threads * ALIGN), (
        "rule: reads in several threads at once are each counted"
    )


def test_close_deletes_the_file(files: Callable[..., RecordFile]) -> None:
    file = files(ALIGN)
    path = file.path
    file.close()
    assert not path.exists(), "rule: close deletes the file it created"
    assert file.allocated_bytes() == 0, "rule: a closed file occupies nothing"
    file.close()  # a second close does nothing


def test_a_full_disk_fails_at_construction_naming_path_bytes_and_room_leaving_nothing(
    small_fs: Path,  # noqa: F811  # the fixture imported above
) -> None:
    path = small_fs / "state.bin"
    with pytest.raises(DiskTierError) as failed:
        RecordFile(path, 2 * 1024 * 1024, holds="masters of this test")
    message = str(failed.value)
    assert f"{path}: no room" in message and "2097152 bytes (masters of this test)" in message, (
        "rule: a full disk is named with the path, the bytes needed and what they hold"
    )
    assert "are free" in message, "rule: the message gives the bytes free"
    assert not any(small_fs.iterdir()), "rule: a refused file leaves nothing behind"
