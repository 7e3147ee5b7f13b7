"""``zero3-offload train``: real runs on local ranks and under torchrun, resume, Ctrl-C,
config files, the DeepSpeed mapping and one-line errors for bad options.

Runs use a tiny model so the whole file stays well under 90 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from zero3_offload.cli import main
from zero3_offload.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32",
    "--batch-size", "4", "--eval-batches", "2", "--warmup-steps", "0", "--lr", "1e-2",
    "--log-every", "1", "--corpus-mb", "1",
]  # fmt: skip
EVAL = re.compile(r"eval loss (\d+\.\d+) -> (\d+\.\d+)")
STEP = re.compile(r"^step (\d+)/(\d+)  loss (\d+\.\d+)", re.MULTILINE)


def train(*args: str, launcher: tuple[str, ...] | None = None) -> subprocess.CompletedProcess:
    command = [*(launcher or (sys.executable, "-m")), "zero3_offload", "train", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def steps(out: str) -> dict[int, str]:
    return {int(m[1]): m[3] for m in STEP.finditer(out)}


def loss_fell(out: str) -> None:
    first, last = map(float, EVAL.search(out).groups())
    assert last < first, out


def latest(out_dir: Path) -> str:
    return (out_dir / "checkpoints" / "latest").read_text().strip()


# 30336 parameters: fp32 values and Adam state take 364032 bytes, more than this budget;
# one rank (which would hold them all) is refused, two ranks train.
BUDGET = ("--cpu-memory-budget", "300000")


def two_ranks_args(run: Path) -> tuple[str, ...]:
    """A 2-rank run of 12 steps under ``BUDGET`` (without --save-every)."""
    return ("--world-size", "2", "--steps", "12", "--out", str(run), *BUDGET, *SMALL)


def toml_config(path: Path) -> Path:
    """``SMALL`` as a TOML config file."""
    pairs = zip(SMALL[0::2], SMALL[1::2], strict=True)
    path.write_text("".join(f"{flag[2:].replace('-', '_')} = {v}\n" for flag, v in pairs))
    return path


TORCHRUN = ("torchrun", "--standalone", "--nproc-per-node", "2", "-m")


@pytest.fixture(scope="module")
def started(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[Future[subprocess.CompletedProcess], Path]]]:
    """The runs that need no run before them, started with the module, two at a time
    (independent processes: one's imports use the core the other leaves idle), each
    with its directory: the 2-rank run under ``BUDGET`` saving every 4 steps, the
    1-rank run that budget refuses, the torchrun job with a TOML config, and a
    ``--resume`` without a checkpoint."""
    dirs = {n: tmp_path_factory.mktemp(n) for n in ("two", "one", "torchrun", "no-ckpt")}
    config = toml_config(dirs["torchrun"] / "small.toml")
    calls = {
        "two": ((*two_ranks_args(dirs["two"] / "run"), "--save-every", "4"), None),
        "one": (("--world-size", "1", "--steps", "2", *BUDGET, *SMALL), None),
        "torchrun": (
            ("--steps", "4", "--config", str(config), "--out", str(dirs["torchrun"] / "run")),
            TORCHRUN,
        ),
        "no-ckpt": (("--resume", "--out", str(dirs["no-ckpt"])), None),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            name: (pool.submit(train, *args, launcher=launcher), dirs[name])
            for name, (args, launcher) in calls.items()
        }


@pytest.fixture(scope="module")
def two_ranks(started: dict[str, Any]) -> tuple[Path, tuple[str, ...], str]:
    """The 2-rank run under ``BUDGET``, shared by the tests that read it: its
    directory, its arguments (without --save-every) and stdout."""
    future, directory = started["two"]
    run = directory / "run"
    return run, two_ranks_args(run), ok(future.result())


@pytest.mark.slow
def test_two_ranks_save_resume_and_continue_the_data(
    two_ranks: tuple[Path, tuple[str, ...], str], capsys
) -> None:
    run, args, out = two_ranks
    loss_fell(out)
    straight = steps(out)
    assert sorted(straight) == list(range(1, 13))
    assert latest(run) == "step-00000012"
    for rank in (0, 1):
        events = [json.loads(line) for line in (run / "logs" / f"rank{rank}.jsonl").open()]
        assert {"manager_ready", "step", "train_step", "checkpoint_saved"} <= {
            e["event"] for e in events
        }
        # The backward is token-weighted: every step counts 2 ranks x 4 x 32 label tokens.
        assert {e["tokens"] for e in events if e["event"] == "step"} == {2 * 4 * 32}
    assert main(["analyze", "--json", *map(str, sorted((run / "logs").glob("*.jsonl")))]) == 0

    # As if the run had stopped after step 8: resume continues from there, with
    # the data and learning rates of the uninterrupted run, so the same losses.
    (run / "checkpoints" / "latest").write_text("step-00000008")
    resumed = ok(train(*args, "--resume"))
    assert f"resumed from {run / 'checkpoints' / 'step-00000008'} at step 8" in resumed
    assert steps(resumed) == {s: loss for s, loss in straight.items() if s > 8}
    assert latest(run) == "step-00000012"

    # The user error below runs in this process (the command's own main): the runs above
    # and the tests further down cover the real process's exit code.
    capsys.readouterr()
    # Resuming with another model (with or without --resume) is refused before any rank
    # starts, naming the option: one line, exit 2.
    for resume in ((), ("--resume",)):
        code, _, err = run_cli(capsys, "--world-size", "2", "--steps", "14", "--out", str(run),
                               *resume, *SMALL, "--d-model", "48")  # fmt: skip
        assert code == 2, err
        assert err.startswith(f"zero3-offload train: error: --out {run} holds checkpoints of ")
        assert "--d-model (32 in the run, 48 now)" in err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
def test_torchrun_two_processes_with_a_toml_config(started: dict[str, Any]) -> None:
    future, directory = started["torchrun"]
    run = directory / "run"
    out = ok(future.result())
    loss_fell(out)
    assert "on 2 rank(s) (gloo, cpu)" in out or "nccl" in out
    assert sorted(steps(out)) == [1, 2, 3, 4]  # rank 0 alone prints
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    assert latest(run) == "step-00000004"


@pytest.mark.slow
def test_a_model_larger_than_one_ranks_budget_trains_on_two_ranks(
    started: dict[str, Any], two_ranks: tuple[Path, tuple[str, ...], str]
) -> None:
    one = started["one"][0].result()
    assert one.returncode == 2, one.stderr
    assert "but --cpu-memory-budget=300000: raise the budget, use more ranks" in one.stderr
    assert len(one.stderr.strip().splitlines()) == 1 and "Traceback" not in one.stderr
    loss_fell(two_ranks[2])  # the shared run: 2 ranks under the same budget


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_after_a_step_and_saves(tmp_path: Path) -> None:
    run = tmp_path / "run"
    command = [sys.executable, "-m", "zero3_offload", "train", "--steps", "100000",
               "--out", str(run), *SMALL]  # fmt: skip
    # A new session stands in for the terminal: Ctrl-C reaches every process of it.
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 3/"):
            os.killpg(proc.pid, signal.SIGINT)
            break
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    stopped = int(re.search(r"interrupted after step (\d+)/", out)[1])
    assert latest(run) == f"step-{stopped:08d}"
    assert "run the same command again to resume" in out and "Traceback" not in err


# ----------------------------------------------------------------- options, no training


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["train", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


DEEPSPEED = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 5,
    "bf16": {"enabled": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "wall_clock_breakdown": False,
}
UNSUPPORTED = [
    "scheduler.type",
    "scheduler.params.warmup_num_steps",
    "zero_optimization.overlap_comm",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.sub_group_size",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "wall_clock_breakdown",
]


def test_deepspeed_config_maps_keys_and_lists_the_rest(tmp_path: Path, capsys) -> None:
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps(DEEPSPEED))
    code, out, err = run_cli(capsys, "--deepspeed-config", str(ds), "--print-config",
                             "--world-size", "2", "--gradient-clipping", "0.5")  # fmt: skip
    assert code == 0, err
    cfg = json.loads(out)
    train, zero3 = cfg["train"], cfg["zero3"]
    assert (train["lr"], train["batch_size"], train["log_every"]) == (2e-4, 4, 5)
    assert zero3["offload_params"] and zero3["offload_optimizer_states"] and zero3["offload_grads"]
    assert zero3["pin_cpu_memory"] and zero3["compute_dtype"] == "bfloat16"
    assert zero3["prefetch_bucket_size"] == 50_000_000 * 2  # elements x bf16 bytes
    assert zero3["gpu_param_memory_budget"] == 10**9 * 2
    assert zero3["param_persistence_threshold"] == 100_000
    assert zero3["gradient_accumulation_steps"] == 4
    assert zero3["gradient_clipping"] == 0.5  # the explicit flag wins over the file
    assert zero3["optimizer"] | {"fused": None} == {
        "kind": "adamw", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
        "momentum": 0.0, "dampening": 0.0, "nesterov": False, "amsgrad": False, "fused": None,
        "options": {},
    }  # fmt: skip
    for key in UNSUPPORTED:  # one line each, then all of them in one list
        assert re.search(rf"^{re.escape(str(ds))}: unsupported key {re.escape(key)}=", err, re.M)
    assert f"{len(UNSUPPORTED)} unsupported key(s) ignored: {', '.join(UNSUPPORTED)}" in err
    assert "zero_optimization.reduce_bucket_size='auto' ignored" in err


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage=2 is not supported"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type='Lamb' is not supported"),
        ({"fp16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
        ({"train_batch_size": 30}, "train_batch_size=30 is not"),
        ({"gradient_clipping": -1}, "gradient_clipping: gradient_clipping=-1.0 is invalid"),
        (
            {"zero_optimization": {"stage": 3, "zero_quantized_weights": "yes"}},
            "zero_optimization.zero_quantized_weights='yes' is invalid: must be true or false",
        ),
    ],
)
def test_deepspeed_config_errors_name_the_key(tmp_path: Path, capsys, change, expected) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(DEEPSPEED | change))
    code, _, err = run_cli(capsys, "--deepspeed-config", str(ds), "--print-config")
    assert code == 2
    assert err.startswith(f"zero3-offload train: error: {ds}: ") and expected in err, err
    assert len(err.strip().splitlines()) == 1


def test_deepspeed_quantized_weights_and_gradients_map_to_the_wire_options(
    tmp_path: Path, capsys
) -> None:
    ds = tmp_path / "ds.json"
    quantized = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    ds.write_text(json.dumps(DEEPSPEED | {"zero_optimization": {"stage": 3, **quantized}}))
    code, out, err = run_cli(capsys, "--deepspeed-config", str(ds), "--print-config")
    assert code == 0, err
    zero3 = json.loads(out)["zero3"]
    assert (zero3["gather_compression"], zero3["reduce_dtype"]) == ("int8", "bf16")
    assert zero3["cpu_compression"] == "none"  # int8 storage is implied, not written here
    # qgZ has no exact counterpart: the approximation is said, once.
    note = f"{ds}: zero_optimization.zero_quantized_gradients=true read as reduce_dtype='bf16'"
    assert err.count(note) == 1 and "(approximate:" in err
    assert "unsupported key zero_optimization.zero_quantized" not in err
    off = dict.fromkeys(quantized, False)
    ds.write_text(json.dumps(DEEPSPEED | {"zero_optimization": {"stage": 3, **off}}))
    code, out, err = run_cli(capsys, "--deepspeed-config", str(ds), "--print-config")
    zero3 = json.loads(out)["zero3"]
    assert (code, zero3["gather_compression"], zero3["reduce_dtype"]) == (0, "none", "fp32")
    assert "read as reduce_dtype" not in err
    # qwZ sends the stored int8 copies: another stored format is refused, naming the key.
    ds.write_text(json.dumps(DEEPSPEED | {"zero_optimization": {"stage": 3, **quantized}}))
    code, _, err = run_cli(
        capsys, "--deepspeed-config", str(ds), "--print-config", "--cpu-compression", "bf16"
    )
    assert code == 2
    assert (
        f"{ds}: zero_optimization.zero_quantized_weights: gather_compression='int8' is "
        "invalid with cpu_compression='bf16'"
    ) in err


def test_toml_config_is_read_and_flags_override_it(tmp_path: Path, capsys) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        'steps = 7\nlr = 0.01\nseq-len = 64\n\n[zero3]\ncpu_compression = "bf16"\n'
        'cpu_memory_budget = "1GiB"\n\n[optimizer]\nkind = "sgd"\nmomentum = 0.9\n'
    )
    code, out, err = run_cli(capsys, "--config", str(config), "--lr", "0.02", "--print-config")
    assert code == 0, err
    cfg = json.loads(out)
    assert (cfg["train"]["steps"], cfg["train"]["lr"], cfg["train"]["seq_len"]) == (7, 0.02, 64)
    assert cfg["zero3"]["cpu_compression"] == "bf16"
    assert cfg["zero3"]["cpu_memory_budget"] == 2**30
    assert cfg["zero3"]["optimizer"]["kind"] == "sgd"
    assert cfg["zero3"]["optimizer"]["momentum"] == 0.9
    # --print-config writes a --config file: reading it back changes nothing.
    again = tmp_path / "again.json"
    again.write_text(out)
    assert run_cli(capsys, "--config", str(again), "--print-config")[1] == out


CUDA_ABSENT = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--steps", "0"], "--steps=0 is invalid: must be an integer >= 1"),
        (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
        (["--heads", "5"], "--heads=5 is invalid: must divide --d-model=128"),
        (["--lr", "-1"], "--lr=-1.0 is invalid"),
        (["--world-size", "0"], "--world-size=0 is invalid"),
        (["--resume"], "--resume=True is invalid: give --out=DIR"),
        (["--cpu-memory-budget", "lots"], "argument --cpu-memory-budget: 'lots' is not a size"),
        (["--cpu-compression", "zip"], "argument --cpu-compression: invalid choice: 'zip'"),
        (["--gpu-param-memory-budget", "16GiB"], "exceeds --max-gpu-memory-mb=8192"),
        (["--optimizer-momentum", "0.9"], "--optimizer-momentum=0.9 is invalid: applies only"),
        (["--compute-dtype", "int4"], "argument --compute-dtype: invalid choice: 'int4'"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["--stepz", "3"], "unrecognized arguments: --stepz"),
        (["--batch-size", "-3"], "--batch-size=-3 is invalid"),
        (["--config", "missing.toml"], "--config missing.toml: cannot read"),
        pytest.param(["--device", "cuda"], "--device=cuda is invalid: CUDA", marks=CUDA_ABSENT),
    ],
)
def test_bad_options_give_one_line_naming_the_flag(capsys, args, expected) -> None:
    code, _, err = run_cli(capsys, *args, "--print-config")
    assert code == 2
    assert expected in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_config_file_values_name_the_file_and_key(tmp_path: Path, capsys) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("steps = 0\n")
    assert f"{config}: steps=0 is invalid" in run_cli(capsys, "--config", str(config))[2]
    config.write_text("stepz = 3\n")
    assert (
        "unknown key 'stepz'; did you mean 'steps'?" in run_cli(capsys, "--config", str(config))[2]
    )
    config.write_text("steps = [\n")
    assert f"--config {config}: invalid TOML" in run_cli(capsys, "--config", str(config))[2]


@pytest.mark.slow
def test_resume_without_a_checkpoint_in_a_real_process(started: dict[str, Any]) -> None:
    future, tmp_path = started["no-ckpt"]
    proc = future.result()
    assert proc.returncode == 2
    assert proc.stderr == (
        f"zero3-offload train: error: --resume: no checkpoint in {tmp_path / 'checkpoints'} "
        "(no 'latest' file)\n"
    )


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_world_size_must_match_torchrun(capsys, monkeypatch) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    for key, value in (env | {"MASTER_PORT": str(free_port())}).items():
        monkeypatch.setenv(key, value)
    code, _, err = run_cli(capsys, "--world-size", "4", "--print-config")
    assert code == 2 and "--world-size=4 is invalid under torchrun" in err


def rank_pids(run: Path, world_size: int) -> dict[int, int]:
    """Each rank's pid, from the last ``manager_ready`` event of its JSON log (the logs
    of a resumed run go on the same files)."""
    pids = {}
    for rank in range(world_size):
        for line in (run / "logs" / f"rank{rank}.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "manager_ready":
                pids[rank] = event["pid"]
    return pids


def fault_rank_1(run: Path, fault: signal.Signals, at_step: int, *extra: str) -> tuple[int, int]:
    """A 2-rank run (heartbeat 2 s, saving every step) whose rank 1 gets ``fault`` once
    rank 0 printed step ``at_step``; checks the one-line error. Returns (the first step
    the run printed, the step of the last committed checkpoint)."""
    command = [sys.executable, "-m", "zero3_offload", "train", "--world-size", "2",
               "--steps", "100000", "--save-every", "1", "--out", str(run),
               "--heartbeat-timeout-s", "2", *extra, *SMALL]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    printed = []
    for line in proc.stdout:
        printed += [int(m[1]) for m in STEP.finditer(line)]
        if line.startswith(f"step {at_step}/"):
            pid = rank_pids(run, 2)[1]
            os.kill(pid, fault)
            break
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"rank 1 (pid {pid} " in lines[0]
    assert ("the process is stopped" if fault == signal.SIGSTOP else "has exited") in lines[0]
    assert "this rank (0) was waiting for" in lines[0]
    committed = int(latest(run).removeprefix("step-"))
    assert committed >= at_step - 1  # step at_step may have been in its save when the fault came
    return printed[0], committed


@pytest.mark.faults  # with the fault profile: its table stops and kills ranks too
@pytest.mark.slow
def test_a_stopped_or_killed_rank_is_named_in_one_line_and_resume_works(tmp_path: Path) -> None:
    """Rank 1 is stopped (SIGSTOP) at step 3; the run resumed from the last committed
    checkpoint has its rank 1 killed (SIGKILL) two steps later; the next resume trains on."""
    run = tmp_path / "run"
    first, stopped = fault_rank_1(run, signal.SIGSTOP, 3)
    assert first == 1
    first, killed = fault_rank_1(run, signal.SIGKILL, stopped + 2, "--resume")
    assert first == stopped + 1  # resumed after the last checkpoint of the stopped run
    resumed = ok(train("--world-size", "2", "--steps", str(killed + 2), "--out", str(run),
                       "--resume", *SMALL))  # fmt: skip
    assert set(steps(resumed)) == {killed + 1, killed + 2}


def test_any_torch_optimizer_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys,
        "--print-config",
        "--optimizer-kind",
        "torch.optim.RMSprop",
        "--optimizer-options",
        '{"alpha": 0.9, "centered": true}',
    )
    assert code == 0, err
    optimizer = json.loads(out)["zero3"]["optimizer"]
    assert optimizer["kind"] == "torch.optim.RMSprop"
    assert optimizer["options"] == {"alpha": 0.9, "centered": True}
    code, _, err = run_cli(
        capsys, "--optimizer-kind", "torch.optim.RMSprop", "--optimizer-options", "[1]"
    )
    assert code == 2 and "JSON object" in err
    code, _, err = run_cli(
        capsys, "--optimizer-kind", "torch.optim.RMSprop", "--optimizer-options", '{"alfa": 1}'
    )
    assert code == 2 and "takes alpha" in err
