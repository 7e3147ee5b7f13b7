"""Long runs stay flat: the in-memory timeline keeps a bounded number of steps, configuring the
logs again closes the previous file, the free pages of the C heap can be returned, and training
on 2 real ranks adds no thread and no open file after warm-up. RSS over a run is not asserted
here (noisy): ``python benchmarks/run.py soak`` reports it.
"""

from __future__ import annotations

import ctypes.util
import os
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import torch.nn.functional as F

import zero3_offload.logging as zlogging
from zero3_offload import Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.memory import trim_heap
from zero3_offload.stats import (
    PassClock,
    Phase,
    StepCounter,
    StepLog,
    Timeline,
    Zero3PerformanceStats,
)
from zero3_offload.testing import RankContext, run_ranks
from zero3_offload.train.corpus import VOCAB_SIZE, ByteCorpus
from zero3_offload.train.model import GPT, GPTShape

KINDS = ("compute", "gather", "wait")  # recorded per step below, one event per kind and layer
LAYERS = ("embed", "block0", "head")


def record_steps(
    timeline: Timeline,
    counter: StepCounter,
    log: tuple[PassClock, StepLog] | None,
    first: int,
    steps: int,
) -> None:
    """``steps`` steps of 1-second events, each step closed as the manager closes one."""
    for step in range(first, first + steps):
        if log is not None:
            log[0].start(Phase.FORWARD)  # the step's window opens at its training forward
        for kind in KINDS:
            for layer in LAYERS:
                timeline.add(kind, layer, Phase.FORWARD, step, step + 1.0, nbytes=10)
        if log is not None:
            now = time.perf_counter()
            log[1].close_step(updating=now, ended=now, stepped=True)
        else:
            counter.close_step(updated=True)


def counted_timeline(**kwargs: Any) -> tuple[Timeline, StepCounter]:
    counter = StepCounter()
    return Timeline(counter=counter, **kwargs), counter


def test_timeline_keeps_the_events_of_the_last_steps_only() -> None:
    timeline, counter = counted_timeline()
    per_step = len(KINDS) * len(LAYERS)
    steps = timeline.recent_steps + 100
    record_steps(timeline, counter, None, 0, steps)
    events = timeline.events()
    # Before the bound in steps, every event of the 116 steps was kept (under maxlen).
    assert len(events) <= timeline.recent_steps * per_step
    assert {e.step for e in events} == set(range(steps - timeline.recent_steps, steps))
    # The run totals still count every event ever recorded.
    n = steps * len(LAYERS)
    assert timeline.totals()["compute"] == (n, n, 10 * n)
    assert timeline.seconds("wait") == steps * len(LAYERS)


def test_timeline_bound_in_events_applies_whatever_the_steps() -> None:
    timeline, counter = counted_timeline(recent_steps=1000, maxlen=50)
    record_steps(timeline, counter, None, 0, 20)
    assert len(timeline.events()) == timeline.maxlen == 50
    assert timeline.events()[-1].step == 19


def test_timeline_after_loading_an_earlier_step_drops_the_later_events() -> None:
    timeline, counter = counted_timeline(recent_steps=4)
    record_steps(timeline, counter, None, 0, 10)
    # A checkpoint of step 2 was loaded.
    counter.load_state_dict({"optimizer_steps": 2, "timeline_step": 2, "calls_since_update": 0})
    timeline.add("compute", "embed", Phase.FORWARD, 0.0, 1.0)
    assert [e.step for e in timeline.events()] == [2]


def test_performance_stats_of_a_long_run_are_whole_while_the_timeline_is_bounded() -> None:
    (timeline, counter), stats = counted_timeline(recent_steps=8), Zero3PerformanceStats()
    clock = PassClock(stats=stats, timeline=timeline)
    log = StepLog(timeline=timeline, stats=stats, counter=counter, clock=clock)
    record_steps(timeline, counter, (clock, log), 0, 200)
    snap = stats.snapshot(
        timeline, counter=counter, prefetch={}, prefetch_hit_rate=0.0, gathered_high_water_bytes=0
    )
    assert len(snap.timeline) <= 8 * len(KINDS) * len(LAYERS)
    assert {e.step for e in snap.timeline} == set(range(192, 200))
    assert snap.total_compute_time == 200 * len(LAYERS)  # every step's, from the run totals
    assert snap.exposed_communication_time == 200 * len(LAYERS)
    # Every step's wall time, from its window's opening to its close.
    assert len(snap.step_times) == 200 and all(t > 0 for t in snap.step_times)
    assert snap.total_step_time == pytest.approx(sum(snap.step_times))
    assert snap.optimizer_steps == counter.updates == 200


def open_fds(under: Path) -> int:
    """This process's open file descriptors on files under ``under`` (other tests'
    pipes and sockets may close at any time, so they are not counted)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        count += target.startswith(str(under))
    return count


def test_configuring_the_logs_again_closes_the_previous_file(tmp_path: Path) -> None:
    try:
        zlogging.configure(json_path=tmp_path / "first.jsonl")
        assert open_fds(tmp_path) == 1
        for i in range(5):
            zlogging.configure(json_path=tmp_path / f"log{i}.jsonl")
        assert open_fds(tmp_path) == 1  # the last one (6 before the fix)
        zlogging.get_logger(__name__).info("after_reconfiguring", n=1)
        assert "after_reconfiguring" in (tmp_path / "log4.jsonl").read_text(encoding="utf-8")
        assert "after_reconfiguring" not in (tmp_path / "log3.jsonl").read_text(encoding="utf-8")
        zlogging.configure()  # no file: the last one is closed too
        assert open_fds(tmp_path) == 0
    finally:
        structlog.reset_defaults()


def rss_anon() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim"), reason="not glibc"
)
def test_trim_heap_returns_the_free_pages_inside_the_heap() -> None:
    mib = 2**20
    blocks = []
    for _ in range(2048):  # 128 MiB of 64 KiB blocks: below the mmap threshold, in the heap
        block = bytearray(64 * 1024)
        block[::4096] = b"\x01" * 16  # every page touched: resident
        blocks.append(block)
    kept = blocks[::8]  # one block in 8 stays: the free ones sit between them, not at the top
    del blocks
    before = rss_anon()
    assert trim_heap()
    assert before - rss_anon() > 64 * mib  # 112 MiB are free: most of it goes back
    assert len(kept) == 256


# --------------------------------------------------------------- threads and fds on 2 ranks

SHAPE = GPTShape(seq_len=32, d_model=32, layers=2, heads=2)  # the train job's GPT, small
WARMUP, STEPS, EVAL_EVERY, WINDOW = 10, 40, 10, 10


def threads_and_fds() -> tuple[int, int]:
    with open("/proc/self/status", encoding="ascii") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return threads, len(os.listdir("/proc/self/fd"))


async def soak_rank(ctx: RankContext, log_dir: str) -> dict[str, Any]:
    """What a rank of ``zero3-offload train --out`` does each step (JSON log, forward, loss,
    backward with the learning rate, optimizer step, the memory stats the progress line reads,
    an evaluation every EVAL_EVERY steps); the thread and fd counts at the step ends of the
    WINDOW steps right after warm-up and of the last WINDOW steps but one. (At the end of the
    very last step another rank may be closing its group already, which closes rank 0's
    connection of the rendezvous store; one step earlier it still waits for this rank.)"""
    zlogging.configure(json_path=Path(log_dir) / f"rank{ctx.rank}.jsonl")
    corpus = ByteCorpus.load(max_bytes=200_000)
    with torch.device("meta"):
        model = GPT(SHAPE)
    manager = Zero3CpuOffloadManager.from_meta(Zero3CpuOffloadConfig(), ctx.group, model, seed=0)
    names, first, last = list(manager.layer_names), [], []
    async with manager:
        for step in range(WARMUP + STEPS + 1):
            batch = {"seed": 0, "step": step, "first": ctx.rank * 4, "batch_size": 4}
            x, y = corpus.batch(split="train", **batch, seq_len=SHAPE.seq_len)
            out = await manager.forward_pass(x, names)
            logits = out.float().requires_grad_()
            loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))
            loss.backward()
            await manager.backward_pass(logits.grad, names, learning_rate=1e-3)
            await manager.optimizer_step(1e-3)
            manager.get_memory_stats()
            if (step + 1) % EVAL_EVERY == 0:
                with torch.no_grad():
                    await manager.forward_pass(x, names)
            if WARMUP <= step < WARMUP + WINDOW:
                first.append(threads_and_fds())
            elif WARMUP + STEPS - WINDOW <= step < WARMUP + STEPS:
                last.append(threads_and_fds())
        timeline = manager.get_performance_stats().timeline
    return {"first": first, "last": last, "timeline_steps": len({e.step for e in timeline})}


async def test_threads_and_open_fds_stay_flat_after_warmup(tmp_path: Path) -> None:
    # Worker threads start on demand and gloo connects in the first collectives: all within
    # warm-up. What may still differ between two step ends is a thread that is not a leak:
    # comm/collectives.py starts a waiter thread for every gloo reduce-scatter (gloo gives no
    # future), which exits once the collective completed and may not have finished exiting
    # when a step ends on a busy machine. Such a thread only adds, so the fewest threads over
    # WINDOW step ends is the steady count; open fds are exactly the same at every step end.
    for rank, r in enumerate(await run_ranks(soak_rank, 2, str(tmp_path))):
        threads = [min(t for t, _ in r[window]) for window in ("first", "last")]
        assert threads[0] == threads[1], (rank, r)
        fds = {f for window in ("first", "last") for _, f in r[window]}
        assert len(fds) == 1, (rank, r)
        assert r["timeline_steps"] <= Timeline().recent_steps
