"""A true elastic shrink: two torchrun agents as two nodes (``--nnodes 1:2``), one node
lost to SIGKILL, the job goes on on the other by itself.

Real processes killed for real (``train_restarts.shrunk_job``): the surviving node's rank
fails, its agent restarts it, the c10d rendezvous forms again with one node, and the rank
resumes the run of 2 ranks from its last committed checkpoint with gradient accumulation
2 (``train.run_record``): the same sequences per step, so within 1e-5 of the
uninterrupted 2-rank run (only the order of the sums differs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import train_restarts as tr


@pytest.mark.slow
def test_an_elastic_job_that_loses_a_node_goes_on_on_fewer_ranks(tmp_path: Path) -> None:
    reference = tr.reference(tmp_path / "reference")
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
