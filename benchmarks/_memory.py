"""Memory measurement shared by the benchmarks (CPU): allocator peaks from profiler events and /proc counters."""
from __future__ import annotations

import gc


def profiled_peak(fn):
    """(peak bytes of live tensors allocated while ``fn()`` runs, ``fn()``'s result), from the torch profiler's
    memory events; what ``fn`` returns stays alive inside the window, so kept gradients count."""
    from torch.profiler import ProfilerActivity, profile
    gc.collect()
    holder = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        holder["out"] = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, holder["out"]


def proc_status_kib(field: str) -> int:
    """A ``/proc/self/status`` counter in KiB, e.g. ``VmRSS`` or ``VmHWM``."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
