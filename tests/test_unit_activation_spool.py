"""ActivationSpool: a pass's records written and read back bitwise, read ahead one record
at least and more within the budget, each taken once, the file deleted at close."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zero3_offload.errors import DiskTierError, StateError
from zero3_offload.storage.activation_spool import ActivationSpool, aligned_buffer
from zero3_offload.storage.record_file import ALIGN


def _records() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # sizes that are not multiples of the direct-I/O alignment; one empty
    return [torch.randn(n, generator=g) for n in (1000, 1537, 0, 2048, 333)]


def _spool(directory: Path, budget: int, seen: list[tuple[str, int]]) -> ActivationSpool:
    return ActivationSpool(
        directory,
        name="activations-0.bin",
        read_ahead_bytes=budget,
        pin=False,
        on_transfer=lambda what, _s, nbytes: seen.append((what, nbytes)),
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_records_come_back_bitwise_and_the_file_goes_at_close(tmp_path: Path) -> None:
    records, seen = _records(), []
    spool = _spool(tmp_path, 0, seen)
    for t in records:
        spool.put(t.view(torch.uint8))
    spool.finish_writes()
    assert spool.path.exists()
    for i in reversed(range(len(records))):
        data, waited = spool.take(i)
        assert waited >= 0
        assert data.data_ptr() % ALIGN == 0  # a buffer of its own, direct-I/O aligned
        assert torch.equal(data.view(torch.float32), records[i])
        spool.start_reads(i)
    sizes = [_nbytes(t) for t in records if t.numel()]
    assert sorted(n for what, n in seen if what == "write") == sorted(sizes)
    assert sorted(n for what, n in seen if what == "read") == sorted(sizes)
    with pytest.raises(StateError, match="read back twice"):
        spool.take(0)
    spool.close()
    assert list(tmp_path.iterdir()) == []


def test_reads_run_one_record_ahead_and_more_within_the_budget(tmp_path: Path) -> None:
    records = _records()
    sizes = [_nbytes(t) for t in records]
    for budget, expected in ((0, [4]), (sizes[4] + sizes[3] + sizes[2], [4, 3, 2])):
        directory = tmp_path / str(budget)
        directory.mkdir()
        spool = _spool(directory, budget, [])
        for t in records:
            spool.put(t.view(torch.uint8))
        spool.finish_writes()
        spool.start_reads(len(records))
        assert spool.ahead_bytes == sum(sizes[i] for i in expected)
        spool.take(4)
        assert spool.ahead_bytes == sum(sizes[i] for i in expected if i != 4)
        spool.start_reads(4)  # one ahead: record 3 (already under way with the budget)
        if budget == 0:
            assert spool.ahead_bytes == sizes[3]
        spool.close()


def test_a_missing_directory_raises_a_disk_tier_error(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError, match=r"activations-0\.bin"):
        _spool(tmp_path / "gone", 0, [])


def test_aligned_buffers_start_and_end_on_the_alignment() -> None:
    for nbytes in (0, 1, ALIGN, ALIGN + 1):
        buffer = aligned_buffer(nbytes, pin=False)
        assert buffer.data_ptr() % ALIGN == 0
        assert buffer.numel() % ALIGN == 0 and buffer.numel() >= nbytes
