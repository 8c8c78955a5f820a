"""Where a profiled stretch left the device idle, and what the host was doing then.

A host-bound phase (ZeRO's per-parameter hooks, a `.item()`, Python between kernel launches) shows in a profile's
tables only as host time; whether the device waited for it does not. `idle_report` reads torch.profiler's events
(`prof.events()`): the device's busy time per phase (the user annotations named by `phases`, e.g. "grpo.policy";
"-" for work launched outside them), the kernels with the most device time in each phase, and each gap between
device kernels longer than `min_gap_us`, charged to the host operator the launching thread was inside at the gap's
middle (with its two enclosing operators), summed by that chain.
"""
from __future__ import annotations

import bisect
from collections import defaultdict


def _is_device(e) -> bool:
    return getattr(e.device_type, "name", str(e.device_type)) not in ("CPU",)


def _is_kernel(e, phases: tuple[str, ...]) -> bool:
    """A device event that is work (a kernel, copy or memset), not an annotation's span drawn on the device."""
    return _is_device(e) and not getattr(e, "is_user_annotation", False) and e.name not in phases


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


class _Host:
    """The host events of each thread, to find the innermost one running at a time."""

    def __init__(self, events):
        by_thread = defaultdict(list)
        for e in events:
            if not _is_device(e) and e.time_range.end > e.time_range.start:
                by_thread[e.thread].append(e)
        self.threads = {t: sorted(es, key=lambda e: e.time_range.start) for t, es in by_thread.items()}
        self.starts = {t: [e.time_range.start for e in es] for t, es in self.threads.items()}

    def at(self, thread, t: float, scan: int = 4000):
        """The innermost host event of `thread` whose span holds `t` (the latest-starting one), or None."""
        es, starts = self.threads.get(thread, []), self.starts.get(thread, [])
        i = bisect.bisect_right(starts, t) - 1
        for j in range(i, max(i - scan, -1), -1):
            if es[j].time_range.end >= t:
                return es[j]
        return None


def _chain(e, depth: int = 3) -> str:
    names = []
    while e is not None and len(names) < depth:
        names.append(e.name[:60])
        e = e.cpu_parent
    return " < ".join(names) if names else "(no host operator)"


class _Phases:
    """The named annotations' spans; an operator belongs to the one its start falls in, whatever its thread (the
    backward runs on autograd's own thread)."""

    def __init__(self, events, names: tuple[str, ...]):
        self.spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                            if not _is_device(e) and e.name in names)

    def of(self, e) -> str:
        if e is None:
            return "-"
        t = e.time_range.start
        i = bisect.bisect_right(self.spans, (t, float("inf"), "")) - 1
        return self.spans[i][2] if i >= 0 and self.spans[i][1] >= t else "-"


def idle_report(events, phases: tuple[str, ...] = (), min_gap_us: float = 20.0, rows: int = 25,
                kernel_rows: int = 15) -> str:
    """The device's busy and idle time per phase and the idle gaps by host operator chain (see the module's doc)."""
    events = list(events)
    # host operators by correlation id; the CUDA runtime and driver calls that launch work (cudaLaunchKernel,
    # cuLaunchKernelEx for cuBLAS and Triton, cudaGraphLaunch, cudaMemcpyAsync) by theirs, which their work shares
    by_id, runtime = {}, {}
    for e in events:
        if not _is_device(e):
            (runtime if e.name.startswith("cu") else by_id)[e.id] = e
    kernels = sorted((e for e in events if _is_kernel(e, phases)), key=lambda e: e.time_range.start)
    if not kernels:
        return "== device idle: no device events in this profile\n"
    host, phase = _Host(events), _Phases(events, phases)
    # the host operator that launched each kernel: linked by correlation id, else the runtime call of the same id
    launcher = [by_id.get(getattr(k, "linked_correlation_id", 0)) or runtime.get(k.id) for k in kernels]
    where = [phase.of(src) for src in launcher]  # each kernel's phase
    per_phase, top = defaultdict(list), defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for k, name in zip(kernels, where):
        per_phase[name].append((k.time_range.start, k.time_range.end))
        top[name][k.name[:90]][0] += k.time_range.end - k.time_range.start
        top[name][k.name[:90]][1] += 1
    lines = ["== device busy by phase (kernels' union; span: first kernel's start to last kernel's end; -: launched "
             "outside the phases)",
             f"{'phase':<16}{'span ms':>10}{'busy ms':>10}{'idle ms':>10}{'kernels':>9}"]
    for name, spans in sorted(per_phase.items(), key=lambda kv: kv[1][0][0]):
        merged = _merge(spans)
        span = merged[-1][1] - merged[0][0]
        busy = sum(b - a for a, b in merged)
        lines.append(f"{name:<16}{span / 1e3:>10.2f}{busy / 1e3:>10.2f}{(span - busy) / 1e3:>10.2f}{len(spans):>9}")
    lines += ["", "== top kernels by device time, per phase", f"{'ms':>9}{'calls':>8}  phase: kernel"]
    for name in sorted(per_phase, key=lambda n: per_phase[n][0][0]):
        for kname, (t, n) in sorted(top[name].items(), key=lambda kv: -kv[1][0])[:kernel_rows]:
            lines.append(f"{t / 1e3:>9.2f}{n:>8}  {name}: {kname}")
    merged = _merge([(k.time_range.start, k.time_range.end) for k in kernels])
    gaps = defaultdict(lambda: [0.0, 0])
    total = 0.0
    kstarts = [k.time_range.start for k in kernels]
    for (_, end), (start, _) in zip(merged, merged[1:]):
        if start - end <= min_gap_us:  # longer than min_gap_us only
            continue
        i = bisect.bisect_left(kstarts, start)  # the kernel the device waited for
        src = launcher[i]
        inner = host.at(src.thread, (start + end) / 2) if src is not None else None
        key = f"{where[i]}: {_chain(inner)}"
        gaps[key][0] += start - end
        gaps[key][1] += 1
        total += start - end
    lines += ["", f"== device idle gaps over {min_gap_us:.0f} us: {total / 1e3:.2f} ms in all, by the host operator the "
              "launching thread was in at each gap's middle (innermost < parent < grandparent)",
              f"{'idle ms':>9}{'gaps':>7}  phase: host operators"]
    for key, (t, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{t / 1e3:>9.2f}{n:>7}  {key}")
    return "\n".join(lines) + "\n"

