"""CPU affinity: the cores a trainer process or an engine server may run on (``trainer.cpus``,
``rollout.server.cpus``, the server's ``--cpus``). Pinning the trainer and its engine to different cores keeps
each one's single thread on its own core, so an engine generating while the trainer trains (``rollout.overlap``)
competes for no core with it, and a measurement of either says which core it had.

A process may move to any CPU its container or scheduler allows, not only those it inherited: an engine server
started by a trainer pinned to CPU 1 may pin itself to CPU 0."""
from __future__ import annotations

import os
from typing import Optional, Sequence


def cpu_set_problem(cpus) -> Optional[str]:
    """Why ``cpus`` (CPU ids) is not a CPU list of this machine, or None. Whether a container or scheduler lets a
    process run there is known only when it pins itself (:func:`pin_cpus`)."""
    if not isinstance(cpus, (list, tuple)) or not cpus or \
            not all(isinstance(c, int) and not isinstance(c, bool) for c in cpus):
        return f"must be a non-empty list of CPU ids, e.g. [0], got {cpus!r}"
    n = os.cpu_count() or 1
    outside = sorted(c for c in set(cpus) if not 0 <= c < n)
    if outside:
        return f"names CPUs {outside} that this machine does not have (it has 0-{n - 1})"
    return None


def pin_cpus(cpus: Sequence[int]) -> None:
    """Run this process (and the threads and processes it starts from now on) on ``cpus`` only. ValueError, naming
    the CPUs this process may use, when they are not a CPU list or the container or scheduler refuses them."""
    cpus = list(cpus)
    problem = cpu_set_problem(cpus)
    if problem is not None:
        raise ValueError(f"CPU list {problem}")
    before = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, set(cpus))
    except OSError as e:
        raise ValueError(f"cannot run on CPUs {sorted(set(cpus))}: {e.strerror} (this process runs on {before}; a "
                         "container or scheduler may allow fewer CPUs than the machine has)") from None


def parse_cpu_list(text: str) -> list:
    """``"0,2-3"`` -> [0, 2, 3] (the notation of ``taskset -c`` and ``/sys/.../cpulist``)."""
    cpus = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"expected CPU ids such as 0,2-3, got {text!r}")
        cpus += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    return cpus
