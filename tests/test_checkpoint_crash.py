"""Crash and full-disk safety of checkpoint saves: a rank SIGKILLed at any point of a
save, or a write failing with ENOSPC, leaves the previous checkpoint loadable and
resuming from whatever ``latest`` names bitwise exact (docs/checkpoints.md, "Crash
safety")."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fault_points import (
    CONTINUE,
    DISTINCT,
    OTHER_RANK_POINTS,
    RANK0_POINTS,
    SAME_NAME,
    Replay,
    committed,
    io_error,
    kill,
    load,
    no_space,
    replay,
    save,
    save_failing,
    step,
)
from helpers import assert_bitwise, run_in_turn, run_named

from zero3_offload.checkpoint import atomic_save
from zero3_offload.checkpoint.format import METADATA, read_metadata, resolve_checkpoint
from zero3_offload.errors import CheckpointError
from zero3_offload.testing import RankFailedError, run_ranks

A2, B3, C4 = "step-00000002", "step-00000003", "step-00000004"
AFTER = ((step, 10), (step, 11))  # what every reference and resumed run trains last
# Uninterrupted runs, by the checkpoint they saved last before AFTER.
REFERENCES = {
    "distinct-A": (*DISTINCT[:3], *AFTER),
    "distinct-B": (*DISTINCT, (save,), *AFTER),
    "same-name-B": (*SAME_NAME, (save,), *AFTER),
    # test_full_disk_*: A saved, step 2 (its save fails), step 3, C saved.
    "full-disk": (*DISTINCT, (step, 3), (save,), *AFTER),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("references")
    return run_named(2, {k: (replay, str(root / k), h) for k, h in REFERENCES.items()})


def assert_resumed_like(resumed: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    """``resumed`` trained AFTER exactly as ``reference`` did: losses and parameters."""
    for rank, (got, want) in enumerate(zip(resumed, reference, strict=True)):
        assert got["losses"][-len(AFTER) :] == want["losses"][-len(AFTER) :], rank
    assert_bitwise(resumed[0]["state"], reference[0]["state"])


# Each group is one test: a run killed at each point in turn, then one run resuming
# each root in turn (a process start costs more than the training here). The
# first three are one point of each kind per rank and both rename windows.
_SAME_NAME_POINTS = RANK0_POINTS[RANK0_POINTS.index("after:_stage_latest") :]
_ESSENTIAL: dict[tuple[int, str], tuple[str, ...]] = {
    (0, "distinct"): (
        "after:write_shard",
        "after:_write_metadata",
        "after:_move_into_place",
        "after:_point_latest",
    ),
    (0, "same-name"): ("after:_retire_old", "after:_move_into_place"),
    (1, "distinct"): ("after:write_shard", "after:commit_save"),
}
_ALL: dict[tuple[int, str], tuple[str, ...]] = {
    (0, "distinct"): tuple(p for p in RANK0_POINTS if p != "after:_retire_old"),
    (0, "same-name"): _SAME_NAME_POINTS,
    (1, "distinct"): OTHER_RANK_POINTS,
}
KILLS = [
    pytest.param(rank, scenario, points, id=f"rank{rank}-{scenario}")
    for (rank, scenario), points in _ESSENTIAL.items()
] + [
    pytest.param(
        rank,
        scenario,
        tuple(p for p in points if p not in _ESSENTIAL[rank, scenario]),
        id=f"rank{rank}-{scenario}-more",
        marks=pytest.mark.slow,
    )
    for (rank, scenario), points in _ALL.items()
]


@pytest.mark.parametrize(("rank", "scenario", "points"), KILLS)
async def test_kill_at_any_point_of_a_save_resumes_exactly(
    tmp_path: Path,
    references: dict[str, list[dict[str, Any]]],
    rank: int,
    scenario: str,
    points: tuple[str, ...],
) -> None:
    """A is committed, then ``rank`` SIGKILLs itself at ``point`` of saving B; a fresh
    run loads what ``latest`` names (B once it is committed, else A) and trains on
    exactly as an uninterrupted run that saved that checkpoint last."""
    same_name = scenario == "same-name"
    history = SAME_NAME if same_name else DISTINCT
    roots, expected = [], []
    for point in points:
        root, marker = tmp_path / point.replace(":", "-"), tmp_path / f"{point}.killed"
        with pytest.raises(RankFailedError):
            await run_ranks(
                replay, 2, str(root), (*history, (kill, rank, point, str(marker)), (save,))
            )
        assert marker.read_text() == point  # killed there, not failed elsewhere
        name = B3 if same_name or committed(point, same_name=same_name) else A2
        if same_name and point == "after:_retire_old":
            name = f".old-{B3}"  # latest names B3, which is missing until the next rename
        assert resolve_checkpoint(root).name == name, point
        roots.append(root)
        expected.append(name)

    resumed = await run_in_turn(2, *((replay, str(root), CONTINUE) for root in roots))
    for point, root, name, runs in zip(points, roots, expected, resumed, strict=True):
        assert [Path(r["loaded"][0]).name for r in runs] == [name] * 2, point
        if committed(point, same_name=same_name):
            key = f"{scenario}-B"
        else:
            key = "distinct-B" if same_name else "distinct-A"  # same-name A is distinct B
        assert_resumed_like(runs, references[key])
        # The resumed run's save removed what the killed one left.
        left = sorted(os.listdir(root))
        assert not [n for n in left if n.startswith(".")], (point, left)
        assert (root / "latest").read_text().strip() == Path(runs[0]["saved"][-1]).name


async def test_enospc_at_each_write_keeps_the_previous_checkpoint(
    tmp_path: Path, references: dict[str, list[dict[str, Any]]]
) -> None:
    """Rank 1's shard, rank 0's shard, the metadata and ``latest`` in turn fail with
    ENOSPC (injected into the real write); the run goes on and saves, and resumes exactly."""
    root = tmp_path / "ckpt"
    failing = ((1, "shard"), (0, "shard"), (0, "metadata"), (0, "latest"))
    history = (
        *DISTINCT,
        *(action for rank, site in failing for action in ((no_space, rank, site), (save_failing,))),
        (step, 3),
        (save,),
    )
    runs = await run_ranks(replay, 2, str(root), history)
    for r, run in enumerate(runs):
        assert len(run["errors"]) == len(failing)
        for message in run["errors"]:
            assert f"{root / B3}" in message and "the previous checkpoint is kept" in message
        shard1, shard0, metadata, latest = run["errors"]
        assert f".tmp-{B3}/rank-00001-of-00002.part" in shard1
        assert f".tmp-{B3}/rank-00000-of-00002.part" in shard0
        assert f".tmp-{B3}/metadata.json.part" in metadata
        assert f"{root}/.latest.tmp" in latest
        # The rank whose write failed names the error; the others name the rank.
        assert ("No space left on device" in shard1) == (r == 1)
        assert ("rank 1 could not write" in shard1) == (r == 0)
        assert ("No space left on device" in metadata) == (r == 0)
    # Rank 0 undid each failed save before raising: nothing but A is left.
    assert runs[0]["listings"] == [["latest", A2]] * len(failing)
    assert Path(runs[0]["saved"][-1]).name == C4
    assert sorted(os.listdir(root)) == sorted([A2, C4, "latest"])

    at_a, resumed = await run_in_turn(
        2, (replay, str(root), ((load, A2), *AFTER)), (replay, str(root), CONTINUE)
    )
    assert_resumed_like(at_a, references["distinct-A"])
    assert_resumed_like(resumed, references["full-disk"])


async def test_a_failed_rename_puts_the_same_named_checkpoint_back(
    tmp_path: Path, references: dict[str, list[dict[str, Any]]]
) -> None:
    """Re-saving B3 fails after the old B3 was moved aside, then after the new one
    was moved in: each time the old B3 (which ``latest`` names) is put back."""
    root = tmp_path / "ckpt"
    points = ("after:_retire_old", "after:_move_into_place")
    history = (*SAME_NAME, *(a for p in points for a in ((io_error, 0, p), (save_failing,))))
    runs = await run_ranks(replay, 2, str(root), history)
    for run in runs:
        for point, message in zip(points, run["errors"], strict=True):
            assert f"committing {root / B3} failed" in message, message
            assert "the previous checkpoint is kept" in message
            assert point.split(":")[1] in message
    assert runs[0]["listings"] == [sorted([A2, B3, "latest"])] * len(points)
    resumed = await run_ranks(replay, 2, str(root), CONTINUE)
    assert_resumed_like(resumed, references["distinct-B"])  # the first B3: 0, 1, 2


# ------------------------------------------------------------------- a real full disk


async def fill(run: Replay, ballast: str, free_bytes: int) -> None:
    """Rank 0 fills the filesystem of ``ballast`` until ``free_bytes`` are left."""
    if run.ctx.rank != 0:
        return
    chunk = b"\0" * 65536
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while os.write(fd, chunk) == len(chunk):
            pass
    except OSError:
        pass  # full
    finally:
        os.close(fd)
    os.truncate(ballast, max(0, os.path.getsize(ballast) - free_bytes))


async def empty(run: Replay, ballast: str) -> None:
    if run.ctx.rank == 0:
        os.unlink(ballast)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs; skips where mounting is not permitted (needs root)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True, timeout=30)


async def test_full_disk_raises_everywhere_and_training_continues(
    small_fs: Path, references: dict[str, list[dict[str, Any]]]
) -> None:
    root, ballast = small_fs / "ckpt", str(small_fs / "ballast")
    history = (
        *DISTINCT,
        (fill, ballast, 4096),
        (save_failing,),
        (empty, ballast),
        (step, 3),
        (save,),
    )
    runs = await run_ranks(replay, 2, str(root), history)
    for rank, run in enumerate(runs):
        # 4 KiB free: every rank's file (about 28 KiB) fails, and each names its own.
        (message,) = run["errors"]
        assert f"{root}/.tmp-{B3}/rank-{rank:05d}-of-00002.part" in message
        assert "No space left on device" in message
        assert f"{root / B3}" in message and "the previous checkpoint is kept" in message
    assert runs[0]["listings"] == [["latest", A2]]
    assert sorted(os.listdir(root)) == sorted([A2, C4, "latest"])
    at_a, resumed = await run_in_turn(
        2, (replay, str(root), ((load, A2), *AFTER)), (replay, str(root), CONTINUE)
    )
    assert_resumed_like(at_a, references["distinct-A"])
    assert_resumed_like(resumed, references["full-disk"])


# ------------------------------------------------------------------- on-disk states


@pytest.fixture
def saved(tmp_path: Path, references: dict[str, list[dict[str, Any]]]) -> Path:
    """A copy of the committed checkpoint A of the "distinct-A" reference run."""
    source = Path(references["distinct-A"][0]["saved"][0])
    return Path(shutil.copytree(source, tmp_path / "copy"))


def test_a_directory_without_metadata_is_never_loadable(saved: Path, tmp_path: Path) -> None:
    (saved / METADATA).unlink()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve_checkpoint(saved)
    with pytest.raises(CheckpointError, match="unreadable checkpoint metadata"):
        read_metadata(saved)
    root = tmp_path / "root"
    root.mkdir()
    saved.rename(root / A2)
    (root / "latest").write_text(A2)
    with pytest.raises(CheckpointError, match=f"has no {METADATA}"):
        resolve_checkpoint(root)


def test_latest_naming_a_missing_directory_falls_back_to_its_old_copy(
    saved: Path, tmp_path: Path
) -> None:
    # The state a kill between the two renames of a same-named save leaves.
    root = tmp_path / "root"
    root.mkdir()
    (root / "latest").write_text(A2 + "\n")
    with pytest.raises(CheckpointError):
        resolve_checkpoint(root)  # nothing to fall back to
    os.symlink(saved, root / f".old-{A2}")
    with pytest.raises(CheckpointError):
        resolve_checkpoint(root)  # a symlink is never followed
    (root / f".old-{A2}").unlink()
    saved.rename(root / f".old-{A2}")
    assert resolve_checkpoint(root) == root / f".old-{A2}"
    read_metadata(root / f".old-{A2}")


async def trace_fsyncs(run: Replay) -> None:
    """Record, at every fsync of the save that follows, what is fsynced and the root's
    state then: its entries (recursively) and what ``latest`` says."""

    def snapshot() -> dict[str, Any]:
        entries = sorted(str(p.relative_to(run.root)) for p in run.root.rglob("*"))
        return {"entries": entries, "latest": (run.root / "latest").read_text().strip()}

    real = atomic_save.fsync_path

    def traced(path: Path) -> None:
        real(path)
        run.events.append((str(Path(path).relative_to(run.root)), snapshot()))

    atomic_save.fsync_path = traced


async def test_durable_order_of_a_save(tmp_path: Path) -> None:
    """Rank files durable before the metadata exists, the metadata durable before the
    directory is renamed into place, the directory's rename durable before ``latest``
    is replaced, and ``latest`` durable before the save returns."""
    root = tmp_path / "ckpt"
    history = ((step, 0), (save,), (step, 1), (trace_fsyncs,), (save,))
    (run,) = await run_ranks(replay, 1, str(root), history)
    old, new = "step-00000001", "step-00000002"
    tmp, shard = f".tmp-{new}", "rank-00000-of-00001"
    synced = [path for path, _ in run["events"]]
    assert synced == [
        f"{tmp}/{shard}.part",  # the rank file, before its rename
        tmp,  # its rename
        f"{tmp}/{METADATA}.part",  # the metadata, before its rename
        tmp,  # its rename
        ".latest.tmp",  # the new latest, before its rename
        ".",  # the directory's rename
        ".",  # latest's rename
    ]
    states = [state for _, state in run["events"]]
    assert f"{tmp}/{shard}.safetensors" in states[1]["entries"]
    assert f"{tmp}/{METADATA}" not in states[1]["entries"]
    assert f"{tmp}/{METADATA}" in states[3]["entries"]
    assert new in states[5]["entries"] and tmp not in states[5]["entries"]
    assert [s["latest"] for s in states] == [old] * 6 + [new]
    assert sorted(os.listdir(root)) == sorted([old, new, "latest"])
