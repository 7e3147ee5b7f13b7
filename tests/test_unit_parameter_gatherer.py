"""Unit tests of ``ParameterGatherer``: binding, releasing, bytes, the pool, compression, disk.

Real components throughout: a ``ParameterStore`` with real compute copies, real
layouts, and real collectives over a one-rank gloo group made in this process
(``tests/one_rank.py``), where an all-gather is a copy of the rank's own shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from one_rank import one_rank_collectives
from torch import nn

from zero3_offload.comm.collectives import Collectives
from zero3_offload.comm.copy_streams import CopyStreams
from zero3_offload.config import CpuCompressionMethod
from zero3_offload.parameter.codec import ShardCodec
from zero3_offload.parameter.disk_copies import DiskComputeCopies
from zero3_offload.parameter.flat_layout import LayerLayout, build_layouts
from zero3_offload.parameter.gatherer import ParameterGatherer
from zero3_offload.parameter.rank_mapping import Zero3RankMapping
from zero3_offload.parameter.store import ParameterStore
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.timeline import Timeline

CPU = torch.device("cpu")
F32 = torch.float32
BLOCK = 4  # INT8 elements per scale: the layers end in partial blocks


@pytest.fixture(scope="module")
def comm() -> Iterator[Collectives]:
    collectives = one_rank_collectives()
    yield collectives
    collectives.close()


@attrs.define
class Setup:
    gatherer: ParameterGatherer
    store: ParameterStore
    layers: dict[str, nn.Module]
    layouts: dict[str, LayerLayout]
    values: dict[str, dict[str, torch.Tensor]]  # layer -> parameter -> initial values
    timeline: Timeline

    def params(self, name: str) -> dict[str, nn.Parameter]:
        return dict(self.layers[name].named_parameters())


def build(
    comm: Collectives,
    *,
    method: CpuCompressionMethod = CpuCompressionMethod.NONE,
    compressed_wire: bool = False,
    pool_layers: int = 0,
    pool_budget: int = 0,
    disk: Path | None = None,
) -> Setup:
    """Three layers sharded on one rank: their masters stored, their views released."""
    torch.manual_seed(0)
    layers: dict[str, nn.Module] = {
        "a": nn.Linear(5, 3),  # 18 elements
        "b": nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)),  # 24 elements
        "act": nn.ReLU(),  # no parameters
    }
    values = {
        name: {k: p.detach().clone() for k, p in module.named_parameters()}
        for name, module in layers.items()
    }
    layouts = build_layouts(layers, Zero3RankMapping(rank=0, world_size=comm.world_size))
    codec = ShardCodec(method, F32, block_size=BLOCK)
    copies = None
    if disk is not None:
        shards = {n: lay.shard_numel for n, lay in layouts.items() if lay.numel}
        copies = DiskComputeCopies(
            disk, codec=codec, layers=shards, buffers=2, timeline=Timeline(rank=0)
        )
    store = ParameterStore(codec=codec, master_device=CPU, copy_device=CPU, disk=copies)
    timeline = Timeline(rank=0)
    gatherer = ParameterGatherer(
        layers=layers,
        layouts=layouts,
        store=store,
        comm=comm,
        device=CPU,
        streams=CopyStreams(CPU),
        timeline=timeline,
        compressed_wire=compressed_wire,
        pool_layers=pool_layers,
        pool_budget=pool_budget,
    )
    for name, layout in layouts.items():
        store.put_master(name, layout.flatten(layers[name], dtype=F32))
        gatherer.release_views(name)
    return Setup(gatherer, store, layers, layouts, values, timeline)


def kinds(timeline: Timeline) -> list[tuple[str, str, str, int]]:
    return [(e.kind, e.layer, e.phase, e.nbytes) for e in timeline.events()]


# ------------------------------------------------------------------ binding and releasing


async def test_a_gather_binds_every_parameter_as_a_view_of_one_flat_buffer(
    comm: Collectives,
) -> None:
    s = build(comm)
    assert all(p.numel() == 0 for p in s.layers["b"].parameters()), (
        "rule: a sharded layer's parameters hold no values between uses"
    )
    module = await s.gatherer.gather("b", Phase.FORWARD)
    assert module is s.layers["b"], "rule: a gather returns the layer's module"
    flat = s.gatherer.gathered_flat("b")
    for slot in s.layouts["b"].slots:
        param = s.params("b")[slot.name]
        assert torch.equal(param, s.values["b"][slot.name]), (
            "rule: a gather rebuilds the values of the master shard"
        )
        assert param.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), (
            "rule: each parameter is a view of the layer's one flat buffer"
        )
        assert param.storage_offset() == flat.storage_offset() + slot.offset, (
            "rule: each parameter sits at its slot's offset in the flat buffer"
        )


async def test_a_release_empties_the_parameters_and_drops_grads_unless_asked_to_keep_them(
    comm: Collectives,
) -> None:
    s = build(comm)
    await s.gatherer.gather("a", Phase.BACKWARD)
    for p in s.layers["a"].parameters():
        p.grad = torch.ones_like(p)
    s.gatherer.release("a", Phase.BACKWARD, keep_grads=True)
    assert not s.gatherer.is_gathered("a"), "rule: a released layer is not gathered"
    assert all(p.numel() == 0 for p in s.layers["a"].parameters()), (
        "rule: a release points every parameter at an empty tensor"
    )
    assert all(p.grad is not None and p.grad.numel() > 0 for p in s.layers["a"].parameters()), (
        "rule: keep_grads leaves the gradients being accumulated"
    )
    await s.gatherer.gather("a", Phase.BACKWARD)
    s.gatherer.release("a", Phase.BACKWARD)
    assert all(p.grad is None for p in s.layers["a"].parameters()), (
        "rule: a release drops the gradients by default"
    )
    s.gatherer.release("a", Phase.BACKWARD)  # not gathered: nothing to do
    assert [k for k, *_ in kinds(s.timeline)].count("release") == 2, (
        "rule: releasing a layer that is not gathered records nothing"
    )


async def test_a_gathered_layer_is_not_gathered_again(comm: Collectives) -> None:
    s = build(comm)
    first = await s.gatherer.gather("a", Phase.FORWARD)
    flat = s.gatherer.gathered_flat("a")
    again = await s.gatherer.gather("a", Phase.FORWARD)
    assert again is first and s.gatherer.gathered_flat("a") is flat, (
        "rule: a gathered layer is returned as it is, with its buffer"
    )
    assert [k for k, *_ in kinds(s.timeline)].count("gather") == 1, (
        "rule: gathering a gathered layer launches no all-gather"
    )


async def test_a_layer_without_parameters_gathers_without_a_collective(comm: Collectives) -> None:
    s = build(comm)
    assert s.gatherer.nbytes("act") == 0, "rule: a layer without parameters holds no bytes"
    handle = s.gatherer.launch("act", Phase.FORWARD)
    assert handle.pending is None and handle.is_completed(), (
        "rule: a layer without parameters needs no all-gather"
    )
    assert await s.gatherer.complete("act", Phase.FORWARD) is s.layers["act"], (
        "rule: a layer without parameters completes at once"
    )
    assert s.gatherer.is_gathered("act") and s.gatherer.gathered_bytes() == 0, (
        "rule: a layer without parameters is gathered with no bytes"
    )


# ------------------------------------------------------------------ bytes


async def test_in_flight_and_gathered_bytes_are_the_buffers_bytes(comm: Collectives) -> None:
    s = build(comm)
    g = s.gatherer
    sizes = {name: s.layouts[name].padded_numel * 4 for name in ("a", "b")}
    assert {name: g.nbytes(name) for name in sizes} == sizes, (
        "rule: a layer's gather holds its padded flat buffer in the compute dtype"
    )
    g.launch("a", Phase.FORWARD)
    g.launch("b", Phase.FORWARD)
    assert g.is_inflight("a") and not g.is_gathered("a"), (
        "rule: a launched gather is in flight until completed"
    )
    assert (g.inflight_bytes(), g.gathered_bytes()) == (sizes["a"] + sizes["b"], 0), (
        "rule: launched buffers count as in flight"
    )
    await g.complete("a", Phase.FORWARD)
    assert (g.inflight_bytes(), g.gathered_bytes()) == (sizes["b"], sizes["a"]), (
        "rule: a completed gather's bytes move from in flight to gathered"
    )
    assert g.reserved_bytes() == sizes["a"] + sizes["b"], (
        "rule: reserved bytes are gathered plus in flight"
    )
    await g.complete("b", Phase.FORWARD)
    g.release("a", Phase.FORWARD)
    g.release("b", Phase.FORWARD)
    assert g.reserved_bytes() == 0, "rule: released buffers are not reserved"
    assert g.high_water_bytes == sizes["a"] + sizes["b"], (
        "rule: the high-water mark is the most launched plus gathered bytes at once"
    )


async def test_the_timeline_records_each_gather_and_release_with_its_bytes_and_phase(
    comm: Collectives,
) -> None:
    s = build(comm)
    nbytes = s.gatherer.nbytes("a")
    await s.gatherer.gather("a", Phase.INFERENCE)
    s.gatherer.release("a", Phase.INFERENCE)
    assert kinds(s.timeline) == [
        ("gather", "a", "forward", nbytes),
        ("wait", "a", "forward", 0),
        ("release", "a", "forward", nbytes),
    ], "rule: a gather, its wait and its release are recorded, labelled by the pass's work"


# ------------------------------------------------------------------ the pool


async def test_a_released_buffer_is_reused_by_the_next_gather_of_its_size(
    comm: Collectives,
) -> None:
    s = build(comm, pool_layers=2, pool_budget=10**6)
    g = s.gatherer
    await g.gather("a", Phase.FORWARD)
    buffer = g.gathered_flat("a").data_ptr()
    g.release("a", Phase.FORWARD)
    assert g.pooled_bytes() == g.nbytes("a"), "rule: a released CPU buffer is pooled"
    await g.gather("a", Phase.FORWARD)
    assert g.gathered_flat("a").data_ptr() == buffer, "rule: the next gather of its size reuses it"
    assert g.pooled_bytes() == 0, "rule: a pooled buffer taken by a gather leaves the pool"
    assert torch.equal(s.params("a")["weight"], s.values["a"]["weight"]), (
        "rule: a reused buffer holds the gathered values"
    )
    g.release("a", Phase.FORWARD, pool=False)
    assert g.pooled_bytes() == 0, "rule: pool=False frees the buffer at once"


async def test_gathered_in_flight_and_pooled_bytes_stay_within_the_pool_limit(
    comm: Collectives,
) -> None:
    s = build(comm, pool_layers=1, pool_budget=10**6)  # the limit: a's bytes, the median
    g = s.gatherer
    assert g.pool_limit == g.nbytes("a") < g.nbytes("b"), (
        "rule: the pool's limit is pool_layers times a typical layer's gather bytes (the "
        "lower median of the layers with parameters), not the largest layer's"
    )
    await g.gather("a", Phase.FORWARD)
    await g.gather("b", Phase.FORWARD)
    g.release("a", Phase.FORWARD)  # b still gathered: a + b > the limit
    assert g.pooled_bytes() == 0, "rule: a buffer that would pass the pool's limit is freed"
    g.release("b", Phase.FORWARD)
    assert g.pooled_bytes() == 0, "rule: a layer larger than the limit is never pooled"
    await g.gather("a", Phase.FORWARD)
    g.release("a", Phase.FORWARD)
    assert g.pooled_bytes() == g.nbytes("a"), "rule: within the limit, the buffer is pooled"
    limited = build(comm, pool_layers=2, pool_budget=g.nbytes("a"))
    assert limited.gatherer.pool_limit == g.nbytes("a"), "rule: never more than the budget"
    unpooled = build(comm)
    await unpooled.gatherer.gather("a", Phase.FORWARD)
    unpooled.gatherer.release("a", Phase.FORWARD)
    assert unpooled.gatherer.pooled_bytes() == 0, "rule: pool_layers=0 pools nothing"


# ------------------------------------------------------------------ compression


@pytest.mark.parametrize("method", [CpuCompressionMethod.BF16, CpuCompressionMethod.INT8])
async def test_a_compressed_gather_is_bitwise_the_decoded_gather(
    comm: Collectives, method: CpuCompressionMethod
) -> None:
    plain, wire = build(comm, method=method), build(comm, method=method, compressed_wire=True)
    assert not plain.gatherer.compressed_wire and wire.gatherer.compressed_wire, (
        "rule: compressed_wire holds where the stored format differs from the compute dtype"
    )
    for name in ("a", "b"):
        layout = plain.layouts[name]
        codec = plain.store.codec
        expected = codec.decode(plain.store.compute_copy(name))
        await plain.gatherer.gather(name, Phase.FORWARD)
        await wire.gatherer.gather(name, Phase.FORWARD)
        assert torch.equal(plain.gatherer.gathered_flat(name), expected), (
            "rule: a gather sends the decoded compute copy"
        )
        assert torch.equal(wire.gatherer.gathered_flat(name), expected), (
            "rule: a compressed gather decodes after the all-gather, to the same bits"
        )
        assert wire.gatherer.nbytes(name) == plain.gatherer.nbytes(name) + codec.wire_nbytes(
            layout.shard_numel
        ), "rule: a compressed gather in flight also holds the received stored bytes"


def test_a_compressed_wire_is_off_where_the_stored_format_is_the_compute_dtype(
    comm: Collectives,
) -> None:
    s = build(comm, compressed_wire=True)
    assert not s.gatherer.compressed_wire, (
        "rule: with the compute dtype stored, a compressed wire changes nothing"
    )
    assert s.gatherer.nbytes("a") == s.layouts["a"].padded_numel * 4, (
        "rule: without a compressed wire a gather holds the compute-dtype buffer only"
    )


# ------------------------------------------------------------------ compute copies on disk


async def test_a_copy_on_disk_read_before_an_update_is_not_gathered_after_it(
    comm: Collectives, tmp_path: Path
) -> None:
    s = build(comm, disk=tmp_path)
    try:
        g = s.gatherer
        await g.gather("a", Phase.FORWARD)  # the read buffer stays cached for a
        g.release("a", Phase.FORWARD)
        s.store.master("a").add_(1.0)  # an optimizer step
        s.store.refresh_compute_copy("a")  # written to the file
        g.read_ahead(["a", "b"], Phase.STEP)  # a cached read: stale for a
        await g.gather("a", Phase.FORWARD)
        await g.gather("b", Phase.FORWARD)
        assert torch.equal(s.params("a")["bias"], s.values["a"]["bias"] + 1.0), (
            "rule: a read of a compute copy made before its last write is not sent"
        )
        assert torch.equal(s.params("b")["0.weight"], s.values["b"]["0.weight"]), (
            "rule: a gather from disk sends the copy as written"
        )
    finally:
        s.store.disk.close()  # type: ignore[union-attr]  # built with one
