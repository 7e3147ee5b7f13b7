"""Restarts without a person: ``--out DIR`` resumes by itself when its options agree,
``torchrun --max-restarts`` survives SIGKILL of a rank bitwise, a restart on fewer
ranks keeps the global batch (within 1e-5), and an elastic job that loses a node goes
on on the other. See ``zero3_offload.train.run_record``.

The torchrun jobs are real processes killed for real (``train_restarts``); the refusals
run the command in this process and start no rank. The elastic shrink: two torchrun
agents as two nodes (``--nnodes 1:2``), one node lost to SIGKILL; the surviving node's
rank fails, its agent restarts it, the c10d rendezvous forms again with one node, and
the rank resumes the run of 2 ranks from its last committed checkpoint with gradient
accumulation 2: the same sequences per step, so within 1e-5 of the uninterrupted 2-rank
run (only the order of the sums differs).

The three torchrun jobs run with the fault profile (``-m faults``), whose table has the
same three rows; the refusals run in every suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import train_restarts as tr

from zero3_offload.cli import main
from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.train.options import TrainOptions
from zero3_offload.train.run_record import RunRecord


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank run."""
    return tr.reference(tmp_path_factory.mktemp("reference"))


@pytest.mark.faults
@pytest.mark.slow
def test_torchrun_max_restarts_survives_kill_9_of_a_rank_bitwise(
    reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    job = tr.killed_job(out, kill_rank=1, at_step=4)
    assert job["returncode"] == 0, job["stderr"][-3000:]
    assert f"rank 1 (pid {job['pid']} " in job["stderr"] and "has exited" in job["stderr"]
    # The restarted job resumed from the last committed checkpoint by itself.
    assert job["first_step"] is not None and 4 <= job["first_step"] <= 6
    assert tr.bitwise(tr.parameters(out), tr.parameters(reference))
    assert tr.losses(out) == tr.losses(reference)


@pytest.mark.faults
@pytest.mark.slow
def test_a_restart_on_fewer_ranks_keeps_the_global_batch(reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = tr.killed_job(out, kill_rank=1, at_step=5, max_restarts=0)
    assert job["returncode"] != 0 and job["seconds"] is None  # no restart: the job failed
    proc = tr.train(out, world_size=1)  # the same command on 1 rank instead of 2
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "resuming the run of 2 ranks on 1: gradient accumulation 2 keeps its global batch "
        "of 8 sequences" in proc.stderr
    )
    # The same sequences per step; only the order of the sums differs.
    assert tr.max_diff(tr.parameters(out), tr.parameters(reference)) <= 1e-5
    got, want = tr.losses(out), tr.losses(reference)
    assert got.keys() == want.keys()
    assert max(abs(got[s] - want[s]) for s in got) <= 1e-5


# --------------------------------------------------------------- refusals, no ranks


def recorded_run(out: Path, **train: object) -> None:
    """``out`` as a run of ``test_train.SMALL``-like options on 2 ranks that saved a
    checkpoint (the record and a ``latest`` pointer; the refusals read nothing else)."""
    options = TrainOptions(
        d_model=32, layers=1, heads=2, seq_len=32, batch_size=4, out=str(out), **train
    )
    RunRecord.of(options, Zero3CpuOffloadConfig(skip_nonfinite_steps=True), 2).save(out)
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "latest").write_text("step-00000004")


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["train", *args])
    return code, capsys.readouterr().err


SHAPE = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32"]


def test_a_restart_with_other_options_is_refused_naming_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recorded_run(tmp_path)
    code, err = run_cli(capsys, "--out", str(tmp_path), "--world-size", "2", *SHAPE,
                        "--batch-size", "4", "--lr", "1e-3", "--seed", "3")  # fmt: skip
    assert code == 2
    assert err == (
        f"zero3-offload train: error: --out {tmp_path} holds checkpoints of another run: "
        "--lr (0.003 in the run, 0.001 now), --seed (0 in the run, 3 now); give the run's "
        "values to resume it, or another --out\n"
    )
    # At the same world size the accumulation is part of what must agree.
    code, err = run_cli(capsys, "--out", str(tmp_path), "--world-size", "2", *SHAPE,
                        "--batch-size", "4", "--gradient-accumulation-steps", "2")  # fmt: skip
    assert code == 2 and "--gradient-accumulation-steps (1 in the run, 2 now)" in err


def test_a_global_batch_the_ranks_cannot_keep_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recorded_run(tmp_path)
    code, err = run_cli(capsys, "--out", str(tmp_path), "--world-size", "3", *SHAPE,
                        "--batch-size", "4")  # fmt: skip
    assert code == 2
    assert (
        "the run's global batch of 8 sequences (2 ranks x --batch-size 4 x accumulation 1) "
        "cannot be kept on 3 ranks: it is not a multiple of 3 x 4" in err
    )


def test_options_that_change_no_step_may_differ() -> None:
    run = TrainOptions(out="a")
    record = RunRecord.of(run, Zero3CpuOffloadConfig(), 2)
    later = TrainOptions(out="a", steps=600, save_every=5, log_every=1, threads=3)
    config = Zero3CpuOffloadConfig(heartbeat_timeout_s=2.0, prefetch_buffer_size=4)
    assert record.differences(RunRecord.of(later, config, 2)) == []
    other = RunRecord.of(later, Zero3CpuOffloadConfig(compute_dtype="bf16"), 2)
    assert record.differences(other) == ["--compute-dtype ('float32' in the run, 'bfloat16' now)"]


@pytest.mark.faults
@pytest.mark.slow
def test_an_elastic_job_that_loses_a_node_goes_on_on_fewer_ranks(
    reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "elastic" / "run"
    job = tr.shrunk_job(out, at_step=4)
    assert job["returncode"] == 0, job["stderr"][-3000:]
    # Node A's rank found node B's dead and named it; its agent restarted it.
    assert f"rank {job['killed_rank']} (pid {job['pid']} " in job["stderr"]
    assert "has exited" in job["stderr"]
    assert (
        "resuming the run of 2 ranks on 1: gradient accumulation 2 keeps its global batch "
        "of 8 sequences" in job["stderr"]
    )
    assert job["world_size"] == 1
    # The restarted rank resumed from the last committed checkpoint by itself.
    assert job["first_step"] is not None and 4 <= job["first_step"] <= 6
    params = tr.max_diff(tr.parameters(out), tr.parameters(reference))
    got, want = tr.losses(out), tr.losses(reference)
    assert got.keys() == want.keys()
    loss = max(abs(got[s] - want[s]) for s in got)
    print(
        f"\nnode B (rank {job['killed_rank']}) lost: manager built {job['ready_s']:.1f} s and "
        f"training again {job['seconds']:.1f} s after the kill, from step "
        f"{job['first_step']}; max abs diff parameters {params:.1e}, losses {loss:.1e}"
    )
    assert params <= 1e-5 and loss <= 1e-5
