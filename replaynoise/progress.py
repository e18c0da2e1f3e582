"""Progress for long steps: a tqdm bar on stderr (the rule's log) with tokens per second, and where the time
went (``Phases``)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm import tqdm


class TokenProgress:
    """Counts rows done and tokens produced; the engine calls it with the tokens of each finished unit."""

    def __init__(self, total_rows: int, desc: str, initial: int = 0) -> None:
        if initial:
            # Said plainly in the log: a rerun after an interruption continues, it does not start again.
            print(f"{desc}: resuming, {initial} of {total_rows} rows kept from an interrupted run", file=sys.stderr)
        self.bar = tqdm(
            total=total_rows,
            initial=initial,
            desc=desc,
            unit="row",
            file=sys.stderr,
            mininterval=2.0,
            dynamic_ncols=False,
            ncols=100,
        )
        self.tokens = 0
        self.start = time.perf_counter()

    def rows(self, n: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
        self.bar.update(n)

    def close(self, *phases: "Phases") -> None:
        """Close the bar and log one line a benchmark can read (benchmarks/pipeline.py): the generation rate of
        the loop itself, without the job's start-up (imports, model load, kernel compilation); with ``phases``,
        a second line saying where the loop's time went."""
        self.bar.close()
        seconds = time.perf_counter() - self.start
        print(
            f"{self.bar.desc}: done, {self.bar.n - self.bar.initial} rows, {self.tokens} generated tokens in "
            f"{seconds:.1f} s ({self.tokens / max(seconds, 1e-9):.0f} tok/s)",
            file=sys.stderr,
        )
        parts = [p.summary() for p in phases if p.seconds]
        if parts:
            print(f"{self.bar.desc}: time by phase: {'; '.join(parts)}", file=sys.stderr)
        steps = {name: n for p in phases for name, n in p.steps.items()}
        if steps:
            print(
                f"{self.bar.desc}: steps by phase: " + ", ".join(f"{name} {n}" for name, n in steps.items()),
                file=sys.stderr,
            )
        memory = gpu_memory()
        if memory:
            print(f"{self.bar.desc}: GPU memory: {memory}", file=sys.stderr)


class Phases:
    """Wall seconds per named phase of a long step, summed over its calls: where a pass's time goes, read from
    its log without a profiler. ``sync`` waits for queued device work at both ends of a phase, so asynchronous
    GPU work is charged to the phase that queued it (a few waits per batch; the device stays busy between)."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync or (lambda: None)
        self.seconds: dict[str, float] = {}
        self.steps: dict[str, int] = {}

    def count(self, name: str, steps: int) -> None:
        """Model steps run in a phase, so its log gives milliseconds per step (the figure a roofline needs)."""
        self.steps[name] = self.steps.get(name, 0) + steps

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.seconds.items())


def process_seconds() -> float | None:
    """Seconds since this process started (Linux; None elsewhere): a job's time before its first line of work,
    its imports, which no timer inside the process can see."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def gpu_memory() -> str | None:
    """Peak memory this process's torch allocator held, and the device's memory in use now (an engine that
    runs in a process of its own, as vLLM's does, shows only there). Never imports torch: a step that did not
    load it has no GPU memory to report."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    free, total = torch.cuda.mem_get_info()
    return (
        f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, reserved "
        f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB; device in use {(total - free) / 2**30:.2f} of "
        f"{total / 2**30:.2f} GiB"
    )
