"""The long profile of the API fuzz: the state machine of tests/fuzz_machine.py, longer.

    python benchmarks/fuzz.py --examples 200 --steps 40 [--seed S] [--timeout 60]

Runs random sequences of the manager's public calls with good and bad inputs on
2 real gloo ranks (see docs/robustness.md, "Fuzzing"), then prints what it did:
examples tried, steps, calls by kind, refusals by error class, wall time and
failures. Exit status 1 when an invariant failed (hypothesis prints the
shrunk failing sequence first). Without ``--seed`` the examples are new on every
run; the CI profile (tests/test_fuzz.py) is the derandomized, short one.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
# The fuzz's modules live in tests/; rank processes import them by name too (the
# forkserver that starts them inherits this path).
sys.path.insert(0, str(TESTS))

from fuzz_machine import FuzzStats, run_fuzz  # noqa: E402
from fuzz_server import RankServer  # noqa: E402
from hypothesis import HealthCheck, Verbosity, settings  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100, help="examples (default 100)")
    parser.add_argument("--steps", type=int, default=30, help="steps per example (default 30)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds one call may take (default 60)"
    )
    parser.add_argument("--no-shrink", action="store_true", help="report a failure unshrunk")
    parser.add_argument("--verbose", action="store_true", help="print every example's steps")
    args = parser.parse_args(argv)

    phases = settings.default.phases
    if args.no_shrink:
        phases = tuple(p for p in phases if p.name != "shrink")
    profile = settings(
        max_examples=args.examples,
        stateful_step_count=args.steps,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.verbose if args.verbose else Verbosity.normal,
    )
    stats = FuzzStats()
    failed = False
    print(f"fuzz: {args.examples} examples x {args.steps} steps, seed {args.seed}", flush=True)
    with RankServer(2, timeout_s=args.timeout) as server:
        try:
            run_fuzz(server, profile, stats, seed=args.seed)
        except Exception:  # the failing example and its error: report, then exit 1
            traceback.print_exc()
            failed = True
    print(stats.report())
    print("outcome: FAILED" if failed else "outcome: passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
