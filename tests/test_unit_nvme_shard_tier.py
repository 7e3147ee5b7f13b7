"""Unit tests of ``NvmeShardTier``: masters and optimizer state in a real file under tmp_path.

See [Note: disk tier] in ``zero3_offload.optimizer_state.disk_tier``. The tier is
driven as ``ShardOptimizers`` and ``StepRunner`` drive it: the initial masters are
written with ``write_initial``, and each update runs in a worker thread while its
layer is resident; the same updates in memory give the expected values.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
import torch

from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.config import OptimizerConfig, Zero3CpuOffloadConfig
from zero3_offload.errors import DiskTierError, StateError
from zero3_offload.memory.budget import full_size_state_keys
from zero3_offload.optimizer_state.disk_tier import NvmeShardTier, record_bytes
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.timeline import Timeline
from zero3_offload.storage.record_file import ALIGN

CPU = torch.device("cpu")
F32 = torch.float32
LAYERS = {"a": 1000, "b": 1500, "c": 3}  # elements of each master shard
LR = 1e-2


@attrs.define
class Tiered:
    tier: NvmeShardTier
    optimizer: ShardOptimizers
    workers: WorkerThreads
    masters: dict[str, torch.Tensor]  # the tensors the optimizer updates (empty between)
    given_back: list[int]  # one entry per give_back call

    async def step(self, name: str, grad: torch.Tensor) -> None:
        """One update of ``name`` as ``StepRunner.update_layer`` makes it."""
        async with self.optimizer.resident(name, write=True):
            await self.workers.run(
                "cpu-optimizer", name, Phase.STEP, lambda: self.optimizer.step(name, grad, LR)
            )

    async def read(self, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``name``'s master and state tensors as the record holds them (copies)."""
        async with self.optimizer.resident(name, write=False):
            state = self.optimizer.layer_state(name)
            return self.masters[name].clone(), {k: v.clone() for k, v in state.items()}


def initial(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(ord(name))
    return torch.randn(LAYERS[name], generator=g)


def gradient(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + ord(name))
    return torch.randn(LAYERS[name], generator=g)


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[Callable[..., Tiered]]:
    """Builds tiers of ``LAYERS`` with their initial masters written, each in a directory of
    its own under tmp_path, and driven by ``ShardOptimizers``; closes them after."""
    made: list[Tiered] = []

    def make(*, buffers: int = 2, cfg: OptimizerConfig | None = None) -> Tiered:
        cfg = cfg or OptimizerConfig()
        directory = tmp_path / f"rank{len(made)}"
        directory.mkdir()
        given_back: list[int] = []
        tier = NvmeShardTier(
            directory,
            layers=LAYERS,
            state_keys=full_size_state_keys(Zero3CpuOffloadConfig(optimizer=cfg)),
            buffers=buffers,
            io=WorkerThreads(threads=2, timeline=Timeline(rank=0)),
            give_back=lambda: given_back.append(1),
        )
        masters = {name: initial(name) for name in LAYERS}
        for name, master in masters.items():
            tier.write_initial(name, master)
        optimizer = ShardOptimizers(cfg, masters.items(), device=CPU, tier=tier)
        workers = WorkerThreads(threads=2, timeline=Timeline(rank=0))
        made.append(Tiered(tier, optimizer, workers, masters, given_back))
        return made[-1]

    yield make
    for t in made:
        t.tier.close()


def in_memory(cfg: OptimizerConfig | None = None) -> ShardOptimizers:
    return ShardOptimizers(
        cfg or OptimizerConfig(), [(name, initial(name)) for name in LAYERS], device=CPU
    )


# ------------------------------------------------------------------ the file


def test_records_are_aligned_in_layer_order_and_the_file_is_allocated_at_once(
    tiers: Callable[..., Tiered],
) -> None:
    keys = ("exp_avg", "exp_avg_sq")
    assert record_bytes(1000, keys) == 3 * ALIGN, "rule: each tensor is 4096-byte aligned"
    assert record_bytes(1500, keys) == 3 * 2 * ALIGN and record_bytes(3, ()) == ALIGN, (
        "rule: each tensor is 4096-byte aligned; a record without state is its master alone"
    )
    t = tiers(buffers=3)
    assert t.tier.state_keys == keys, "rule: AdamW's full-size state, in record order"
    expected = sum(record_bytes(n, keys) for n in LAYERS.values())
    path = t.tier.file.path
    assert path.name == "state.bin", "rule: the file is state.bin in the rank's directory"
    assert t.tier.file.nbytes == expected, "rule: the file holds every layer's record"
    assert t.tier.file.allocated_bytes() >= expected, "rule: allocated when it is built"
    assert t.tier.buffer_bytes == 3 * record_bytes(1500, keys), (
        "rule: the tier holds its buffers, each the largest record, whatever is resident"
    )
    assert t.tier.file.writes[0] == len(LAYERS), "rule: each initial master is written"
    raw = path.read_bytes()
    offset = 0
    for name, numel in LAYERS.items():
        stored = torch.frombuffer(bytearray(raw[offset : offset + 4 * numel]), dtype=F32)
        assert torch.equal(stored, initial(name)), (
            f"rule: {name}'s record follows the records before it, its master first"
        )
        offset += record_bytes(numel, keys)
    t.tier.close()
    assert not path.exists(), "rule: close deletes the file"


async def test_a_master_is_in_memory_only_while_its_layer_is_resident(
    tiers: Callable[..., Tiered],
) -> None:
    t = tiers()
    assert all(m.numel() == 0 for m in t.masters.values()), (
        "rule: once written, a master tensor holds nothing"
    )
    async with t.optimizer.resident("b", write=False):
        assert torch.equal(t.masters["b"], initial("b")), (
            "rule: a resident master holds its record's values"
        )
        assert t.tier.owns(t.masters["b"]), "rule: ... as a view of one of the tier's buffers"
    assert t.masters["b"].numel() == 0, "rule: after, the master points at nothing again"
    assert not t.tier.has_state("b"), "rule: reading a layer gives it no state"


async def test_training_through_the_tier_is_bitwise_training_in_memory(
    tiers: Callable[..., Tiered],
) -> None:
    for cfg in (OptimizerConfig(), OptimizerConfig(kind="sgd", momentum=0.9)):
        t = tiers(cfg=cfg)
        memory = in_memory(cfg)
        for step in range(3):
            if step == 2:  # a reset between steps: the records' state is unused again
                t.optimizer.reset()
                memory.reset()
                assert not any(t.tier.has_state(n) for n in LAYERS), (
                    "rule: a reset leaves every record's state part unused"
                )
            for name in LAYERS:
                await t.step(name, gradient(name, step))
                memory.step(name, gradient(name, step), LR)
        for name in LAYERS:
            master, state = await t.read(name)
            assert torch.equal(master, memory.master(name)), (
                f"rule: the tier's {cfg.kind} masters are bitwise those trained in memory"
            )
            want = memory.layer_state(name)
            assert state.keys() == want.keys(), (
                "rule: the tier's state has the keys the optimizer keeps in memory"
            )
            for key in want:
                assert torch.equal(state[key], want[key]), f"rule: and its {key}, bitwise"


async def test_the_first_step_moves_the_state_into_the_record_and_gives_memory_back(
    tiers: Callable[..., Tiered],
) -> None:
    t = tiers()
    await t.step("a", gradient("a", 0))
    assert t.given_back == [1], "rule: state made in memory by a first step is given back"
    assert t.tier.has_state("a") and not t.tier.has_state("b"), (
        "rule: a record holds state once its layer has been stepped"
    )
    assert set(t.optimizer.layer_state("a")) == {"step"}, (
        "rule: between updates only the scalar step stays in memory"
    )
    assert t.optimizer.state_bytes() == 4, "rule: the step counter is all the state held"
    await t.step("a", gradient("a", 1))
    assert t.given_back == [1], "rule: later steps update the record in place: nothing to give"
    async with t.optimizer.resident("a", write=False):
        state = t.optimizer.layer_state("a")
        assert all(t.tier.owns(state[key]) for key in t.tier.state_keys), (
            "rule: a resident layer's state tensors are views of the tier's buffer"
        )


async def test_a_layer_resident_without_write_is_not_written_back(
    tiers: Callable[..., Tiered],
) -> None:
    t = tiers()
    writes = t.tier.file.writes[0]
    async with t.optimizer.resident("a", write=False):
        t.masters["a"].add_(1.0)
    assert t.tier.file.writes[0] == writes, "rule: write=False writes nothing back"
    master, _ = await t.read("a")
    assert torch.equal(master, initial("a")), "rule: the record keeps the values written"


# ------------------------------------------------------------------ buffers and refusals


async def test_with_one_buffer_a_layer_waits_until_the_one_resident_is_written_back(
    tiers: Callable[..., Tiered],
) -> None:
    t = tiers(buffers=1)
    log: list[str] = []

    async def update(name: str) -> None:
        async with t.optimizer.resident(name, write=True):
            log.append(f"in {name}")
            await t.workers.run(
                "cpu-optimizer",
                name,
                Phase.STEP,
                lambda: t.optimizer.step(name, gradient(name, 0), LR),
            )
            log.append(f"out {name}")

    await asyncio.gather(*(update(name) for name in LAYERS))
    assert log == ["in a", "out a", "in b", "out b", "in c", "out c"], (
        "rule: a layer is resident only in a free buffer; it waits for one otherwise"
    )


async def test_a_layer_already_resident_is_refused(tiers: Callable[..., Tiered]) -> None:
    t = tiers()
    async with t.optimizer.resident("a", write=False):
        with pytest.raises(StateError, match="'a' is already resident"):
            async with t.tier.resident("a", t.masters["a"], {}, write=False):
                pass
        assert torch.equal(t.masters["a"], initial("a")), "rule: the resident layer stays"


async def test_state_with_other_tensors_than_the_records_is_refused(
    tiers: Callable[..., Tiered],
) -> None:
    t = tiers(buffers=1)
    with pytest.raises(StateError, match=r"has \['exp_avg'\]; the disk tier expects"):
        async with t.optimizer.resident("a", write=True):
            t.optimizer.load_layer_state("a", {"exp_avg": torch.zeros(LAYERS["a"])})
    assert t.masters["a"].numel() == 0, "rule: a refused write-back leaves the master empty"
    master, _ = await t.read("a")  # the one buffer was given back
    assert torch.equal(master, initial("a")), "rule: a refused write-back leaves the record"


async def test_a_failed_read_raises_a_disk_tier_error_naming_the_file(
    tiers: Callable[..., Tiered],
) -> None:
    t = tiers(buffers=2)
    os.truncate(t.tier.file.path, 0)  # the disk loses the records
    for _ in range(2):  # a failed read leaves the layer not resident: the same error again
        with pytest.raises(DiskTierError, match=r"read of .*state\.bin at byte 0 stopped short"):
            async with t.optimizer.resident("a", write=True):
                pass
