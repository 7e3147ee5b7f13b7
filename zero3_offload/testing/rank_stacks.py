"""A rank's stacks as a report shows them: its asyncio tasks, then its busy threads.

The rank writes both in ``faulthandler``'s format (see [Note: rank stacks] in
``testing.rank_pool``): a header per thread or task, then its frames, most
recent call first. Here they are turned into traceback order with each line's
source, without the frames of the rank's own plumbing (this package,
``multiprocessing``, ``threading``) and without threads that are only that
plumbing or an event loop waiting for its tasks.
"""

from __future__ import annotations

import linecache
import os
import re

__all__ = ["format_stacks", "write_frames"]

_HEADER = re.compile(r"^(?P<what>.+?) \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(?P<file>.+)", line (?P<line>\d+) in (?P<name>.+)$')
_OWN = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PLUMBING = (_OWN, f"{os.sep}multiprocessing{os.sep}", f"{os.sep}threading.py", "<string>")
_EVENT_LOOP = (f"{os.sep}asyncio{os.sep}", f"{os.sep}selectors.py")


def write_frames(header: str, frames: list[tuple[str, int, str]]) -> str:
    """One block in ``faulthandler``'s format; ``frames`` are (file, line, function),
    most recent call first."""
    lines = [f"{header} (most recent call first):"]
    lines += [f'  File "{file}", line {line} in {name}' for file, line, name in frames]
    return "\n".join(lines) + "\n"


def _blocks(raw: str) -> list[tuple[str, list[tuple[str, int, str]]]]:
    blocks: list[tuple[str, list[tuple[str, int, str]]]] = []
    for line in raw.splitlines():
        header = _HEADER.match(line)
        if header:
            blocks.append((header["what"], []))
            continue
        frame = _FRAME.match(line)
        if frame and blocks:
            blocks[-1][1].append((frame["file"], int(frame["line"]), frame["name"]))
    return blocks


def format_stacks(raw: str) -> str:
    """The tasks and threads of one rank's stack file, outermost call first."""
    tasks, threads = [], []
    for what, frames in _blocks(raw):
        kept = [f for f in reversed(frames) if not f[0].startswith(_PLUMBING[0])]
        kept = [f for f in kept if not any(p in f[0] for p in _PLUMBING[1:])]
        if not kept:
            continue
        is_task = what.startswith("asyncio task")
        if not is_task:  # a thread: from where it leaves the event loop's own frames
            while kept and any(p in kept[0][0] for p in _EVENT_LOOP):
                kept.pop(0)
            if not kept:
                continue  # an event loop waiting: its tasks say for what
        label = re.sub(r"^(Current thread|Thread)", "thread", what)
        lines = [f"{label}:"]
        for file, line, name in kept:
            lines.append(f'  File "{file}", line {line}, in {name}')
            source = linecache.getline(file, line).strip()
            if source:
                lines.append(f"    {source}")
        (tasks if is_task else threads).append("\n".join(lines))
    return "\n".join(tasks + threads) or "(no Python frame outside the test's plumbing)"
