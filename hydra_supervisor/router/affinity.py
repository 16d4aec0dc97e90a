"""Which CPUs the router's threads run on (the node's ``router_cpus``).

Every router thread (acceptor, session workers, body pump) runs Python under the process's one
GIL. Spread over many cores, each hand-off of the GIL between them is a futex wake of a thread
on another core, and with dozens of sessions runnable at once the threads spend their time
waking each other instead of serving: on the 16-core host 64 streams arriving together got
their first byte +6.4–6.6 ms after direct through the request-aware leg, and the same router
with its threads on one CPU −1.1 ms (and 406 µs of CPU per request instead of 656–672 µs;
docs/measurements.md "The HTTP leg's cost"). Bytes the threads move without the GIL (splice,
recv, send) still run while another thread holds it, on that one CPU.

- ``auto`` (the default): one CPU of those this process may run on, the one least busy since
  boot (``/proc/stat``; CPU 0, which takes most interrupts, loses ties); nothing is pinned
  when the process may run on one CPU only.
- ``all``: no pinning (the kernel places the threads).
- a list of CPU numbers: those.

Only the router's own threads are pinned (each pins itself as it starts): the event loop's
thread, and so every process hydra starts (llama-server, ggml-rpc-server: a child inherits the
mask of the thread that forks it), keep the whole set.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence

AUTO = "auto"
ALL = "all"
CpuSpec = str | Sequence[int]
STAT = "/proc/stat"


def busy_since_boot(stat_text: str) -> dict[int, float]:
    """Each CPU's busy share of its time since boot, from /proc/stat's ``cpuN`` lines (busy:
    everything but idle and iowait)."""
    out: dict[int, float] = {}
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit():
            continue
        ticks = [int(x) for x in rest.split()]
        total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
        out[int(name[3:])] = (total - idle) / total if total else 0.0
    return out


def pick(allowed: Iterable[int], busy: dict[int, float]) -> int:
    """The least busy CPU of ``allowed`` (one /proc/stat does not list: counted idle); a tie
    goes to the highest number, so CPU 0 comes last."""
    return min(allowed, key=lambda c: (busy.get(c, 0.0), -c))


def choose(spec: CpuSpec, allowed: frozenset[int], stat_text: str) -> frozenset[int] | None:
    """The CPUs to pin the router's threads to, or None for no pinning. Raises ValueError
    (its text says which CPUs may be used) for a list naming a CPU outside ``allowed``."""
    if spec == ALL:
        return None
    if spec == AUTO:
        if len(allowed) <= 1:
            return None
        return frozenset({pick(allowed, busy_since_boot(stat_text))})
    if isinstance(spec, str):
        raise ValueError(f"router_cpus is {spec!r}; use {AUTO}, {ALL} or a list of CPU numbers")
    wanted = frozenset(spec)
    outside = sorted(wanted - allowed)
    if not wanted or outside:
        raise ValueError(
            f"router_cpus names CPU {', '.join(map(str, outside)) or '(none)'}, which this "
            f"process may not run on (it may use {span(allowed)})")
    return wanted


def for_process(spec: CpuSpec) -> frozenset[int] | None:
    """``choose`` for this process: its own CPU mask and this host's /proc/stat (none read:
    no pinning under ``auto``)."""
    allowed = frozenset(os.sched_getaffinity(0))
    try:
        with open(STAT, encoding="ascii") as f:
            text = f.read()
    except OSError:
        text = ""
    if spec == AUTO and not text:
        return None
    return choose(spec, allowed, text)


def span(cpus: Iterable[int]) -> str:
    """CPU numbers as the kernel writes a list: ``0-3,6``."""
    runs: list[list[int]] = []  # consecutive numbers
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def pinned(factory: Callable[..., threading.Thread],
           cpus: frozenset[int] | None,
           pin: Callable[[frozenset[int]], None] | None = None) -> Callable[..., threading.Thread]:
    """A thread factory like ``factory`` whose threads first pin themselves to ``cpus`` (the
    same factory when None). A CPU taken away since (a cgroup change) leaves that thread where
    the kernel puts it."""
    if cpus is None:
        return factory
    do_pin = pin if pin is not None else _pin_self

    def make(*, target: Callable[..., object], args: tuple[object, ...] = (),
             **kw: object) -> threading.Thread:
        def run(*a: object) -> None:
            try:
                do_pin(cpus)
            except OSError:
                pass  # EINVAL: none of them is ours any more; run unpinned
            target(*a)
        return factory(target=run, args=args, **kw)

    return make


def _pin_self(cpus: frozenset[int]) -> None:
    os.sched_setaffinity(0, cpus)  # 0: the calling thread (Linux masks are per thread)
