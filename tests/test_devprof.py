"""engine/devprof.py: the device's idle time per phase and by the host operator it waited for, on made-up events."""
from types import SimpleNamespace as NS

from engine.devprof import idle_report

CPU, CUDA = NS(name="CPU"), NS(name="CUDA")


def ev(id, name, start, end, device=CPU, thread=1, parent=None, corr=0):
    return NS(id=id, name=name, time_range=NS(start=start, end=end), device_type=device, thread=thread,
              cpu_parent=parent, linked_correlation_id=corr)


def test_idle_gaps_are_charged_to_their_phase_and_host_operator():
    a = ev(1, "phase.a", 0, 100)
    b = ev(2, "phase.b", 100, 1000)
    mm = ev(3, "aten::mm", 10, 12, parent=a)
    hook = ev(4, "AccumulateGrad", 120, 700, thread=2)  # another thread (autograd's): phase by start time
    inner = ev(5, "aten::copy_", 130, 690, thread=2, parent=hook)
    add = ev(6, "aten::add", 701, 703, thread=2, parent=hook)
    k1 = ev(11, "gemm", 20, 110, device=CUDA, corr=3)
    k2 = ev(12, "add_kernel", 710, 730, device=CUDA, corr=6)  # waited 600 us for the host (110 -> 710)
    k3 = ev(13, "add_kernel", 735, 745, device=CUDA, corr=6)  # a 5 us gap: under the threshold
    out = idle_report([a, b, mm, hook, inner, add, k1, k2, k3], ("phase.a", "phase.b"), min_gap_us=20)
    lines = out.splitlines()
    row = {l.split()[0]: l.split()[1:] for l in lines[2:4]}
    assert row["phase.a"] == ["0.09", "0.09", "0.00", "1"]
    assert row["phase.b"] == ["0.04", "0.03", "0.01", "2"]  # span 710-745, busy 30
    gaps = [l for l in lines[lines.index(next(l for l in lines if "idle gaps" in l)):] if "phase.b:" in l]
    assert len(gaps) == 1 and gaps[0].split()[:2] == ["0.60", "1"]
    assert gaps[0].endswith("aten::copy_ < AccumulateGrad")  # the innermost operator at the gap's middle, then up
    assert "0.60 ms in all" in out
    assert "     0.03       2  phase.b: add_kernel" in lines and "     0.09       1  phase.a: gemm" in lines


def test_a_kernel_without_a_linked_operator_takes_its_runtime_calls_phase():
    a = ev(1, "phase.a", 0, 100)
    launch = ev(7, "cuLaunchKernelEx", 10, 12)  # the driver call (cuBLAS, Triton) has the kernel's correlation id
    k = ev(7, "gemm", 20, 60, device=CUDA)
    drawn = ev(8, "phase.a", 20, 90, device=CUDA)  # the annotation's span on the device: no kernel
    drawn.is_user_annotation = True
    lines = idle_report([a, launch, k, drawn], ("phase.a",)).splitlines()
    assert lines[2].split() == ["phase.a", "0.04", "0.04", "0.00", "1"]


def test_no_device_events_says_so():
    assert "no device events" in idle_report([ev(1, "x", 0, 1)])


def section(out: str, title: str) -> list[str]:
    """The rows of the report's section whose header line contains `title` (after its column header line)."""
    lines = out.splitlines()
    i = next(i for i, l in enumerate(lines) if title in l)
    rows = []
    for line in lines[i + 2:]:
        if not line.strip():
            break
        rows.append(line)
    return rows


def charged(host: list) -> str:
    """What one 800 us gap (100 -> 900, middle 500) is charged to: thread 1 runs the `host` events (in the order
    given) and, after the middle, the operator launching the kernel that ends the gap."""
    p = ev(1, "p", 0, 2000, thread=9)
    first = ev(2, "aten::first", 1, 2, thread=9, parent=p)
    launch = ev(3, "aten::launch", 890, 891)
    ks = [ev(11, "k1", 90, 100, device=CUDA, corr=2), ev(12, "k2", 900, 910, device=CUDA, corr=3)]
    rows = section(idle_report([p, first, launch, *host, *ks], ("p",), min_gap_us=20), "device idle gaps")
    assert len(rows) == 1 and rows[0].split()[:2] == ["0.80", "1"], rows
    return rows[0].split(None, 2)[2]


def test_the_gap_goes_to_the_host_operator_whose_span_holds_its_middle():
    """The operator charged with a gap is the latest-starting one of the launching thread whose span holds the
    gap's middle, both ends included: the thread's first event, one starting or ending exactly at the middle, an
    instant (zero-length) event such as the profiler's memory records never, and the thread's events in any order.
    [fails if: the backward scan stops before the thread's first event, an event starting or ending exactly at the
    middle is passed over, zero-length events count, or a thread's events are not sorted by start]"""
    outer = ev(4, "aten::outer", 0, 1000)
    assert charged([outer]) == "p: aten::outer"
    assert charged([outer, ev(5, "[memory]", 500, 500, parent=outer)]) == "p: aten::outer"
    assert charged([outer, ev(5, "aten::starts", 500, 600, parent=outer)]) == "p: aten::starts < aten::outer"
    assert charged([outer, ev(5, "aten::ends", 400, 500, parent=outer)]) == "p: aten::ends < aten::outer"
    inner = ev(5, "aten::inner", 450, 550, parent=outer)
    assert charged([ev(6, "aten::late", 700, 800, parent=outer), inner, outer]) == "p: aten::inner < aten::outer"


def test_a_gap_with_no_host_operator_running_says_so():
    """Nothing running on the launching thread at the gap's middle, or no launching operator known for the kernel
    (no linked operator, no runtime call of its id: phase "-"): "(no host operator)".
    [fails if: an empty chain is written as an empty name]"""
    assert charged([ev(4, "aten::before", 10, 20)]) == "p: (no host operator)"
    k1, k2 = ev(11, "k1", 0, 10, device=CUDA), ev(12, "k2", 100, 110, device=CUDA)
    assert [r.split(None, 2)[2] for r in section(idle_report([k1, k2]), "device idle gaps")] == [
        "-: (no host operator)"]


def test_an_operator_belongs_to_the_phase_whose_span_holds_its_start():
    """Phases given out of order (p2's annotation first): an operator starting at a phase's first or last
    microsecond is in it; one starting before every phase is in none ("-"), though the last phase is still to
    come. [fails if: the phases' spans are not sorted, a span's start or end is not included, or an operator before
    the first phase takes the last phase]"""
    p1, p2 = ev(1, "p1", 100, 200), ev(2, "p2", 300, 400)
    ops = [ev(3, "aten::before", 5, 6), ev(4, "aten::at_start", 100, 101, parent=p1),
           ev(5, "aten::at_end", 200, 201), ev(6, "aten::in_p2", 350, 351, parent=p2)]
    ks = [ev(11, "k_before", 10, 20, device=CUDA, corr=3), ev(12, "k_at_start", 110, 120, device=CUDA, corr=4),
          ev(13, "k_at_end", 210, 220, device=CUDA, corr=5), ev(14, "k_in_p2", 360, 370, device=CUDA, corr=6)]
    out = idle_report([p2, p1, *ops, *ks], ("p1", "p2"))
    assert [r.split(None, 2)[2] for r in section(out, "top kernels")] == [
        "-: k_before", "p1: k_at_start", "p1: k_at_end", "p2: k_in_p2"], out


def test_the_gap_goes_to_the_kernel_that_ends_it_when_streams_overlap():
    """Kernels on two streams: B (150-400) starts first after the gap (100 -> 150), C (160-170) runs inside B and
    ends first. The gap is charged to B's launch (phase p.b), as the device waited for B. [fails if: the kernels are
    ordered by their end, so the gap's kernel is looked up in unsorted starts (C, phase p.c)]"""
    pa, pb, pc = ev(1, "p.a", 0, 100), ev(2, "p.b", 140, 145), ev(3, "p.c", 146, 148)
    ops = [ev(4, "aten::a", 1, 2, parent=pa), ev(5, "aten::wait", 101, 139), ev(6, "aten::b", 141, 142, parent=pb),
           ev(7, "aten::c", 147, 147.5, parent=pc)]
    ks = [ev(11, "A", 0, 100, device=CUDA, corr=4), ev(12, "B", 150, 400, device=CUDA, corr=6),
          ev(13, "C", 160, 170, device=CUDA, corr=7)]
    out = idle_report([pa, pb, pc, *ops, *ks], ("p.a", "p.b", "p.c"))
    assert section(out, "device idle gaps") == ["     0.05      1  p.b: aten::wait"], out


def test_phases_are_listed_by_their_first_kernel_not_their_last():
    """p1's kernels start at 0 and 500, p2's at 100: p1 first in both tables. [fails if: either table orders the
    phases by their last kernel]"""
    p1, p2 = ev(1, "p1", 0, 50), ev(2, "p2", 50, 100)
    ops = [ev(3, "aten::x", 1, 2, parent=p1), ev(4, "aten::y", 51, 52, parent=p2)]
    ks = [ev(11, "x1", 0, 10, device=CUDA, corr=3), ev(12, "y", 100, 110, device=CUDA, corr=4),
          ev(13, "x2", 500, 510, device=CUDA, corr=3)]
    out = idle_report([p1, p2, *ops, *ks], ("p1", "p2"))
    assert [r.split()[0] for r in section(out, "device busy by phase")] == ["p1", "p2"], out
    assert [r.split(None, 2)[2] for r in section(out, "top kernels")] == ["p1: x1", "p1: x2", "p2: y"], out


def test_rows_and_kernel_rows_cut_the_tables_and_gaps_of_one_chain_add_up():
    """kernel_rows=2 keeps the phase's two kernels with the most device time (of four); rows=2 the two chains with
    the most idle time (of three), one of them charged with two gaps (100 + 50 us: 0.15 ms, 2 gaps); the total counts
    every gap, listed or not (0.30 ms). [fails if: either cut drops one more row, or a chain's gap count is not
    summed]"""
    p = ev(1, "p", 0, 2000)
    launch = ev(2, "aten::launch", 1, 2, parent=p)
    host = [ev(3, "aten::a", 130, 170), ev(4, "aten::b", 300, 340), ev(5, "aten::a", 410, 420),
            ev(6, "aten::c", 460, 470)]
    ks = [ev(11, "big", 0, 100, device=CUDA, corr=2), ev(12, "mid", 200, 260, device=CUDA, corr=2),
          ev(13, "small", 380, 390, device=CUDA, corr=2), ev(14, "small", 440, 450, device=CUDA, corr=2),
          ev(15, "tiny", 480, 485, device=CUDA, corr=2)]
    out = idle_report([p, launch, *host, *ks], ("p",), rows=2, kernel_rows=2)
    assert section(out, "top kernels") == ["     0.10       1  p: big", "     0.06       1  p: mid"], out
    assert section(out, "device idle gaps") == ["     0.15      2  p: aten::a", "     0.12      1  p: aten::b"], out
    assert "0.30 ms in all" in out


def test_the_default_threshold_is_20_us():
    """bin/bench.py reports with the default threshold: a 20 us gap is not listed, a 21 us one is, and the header
    names it. [fails if: the default min_gap_us is not 20]"""
    for gap, listed in ((20, False), (21, True)):
        p = ev(1, "p", 0, 1000)
        op = ev(2, "aten::mm", 10, 20, parent=p)
        ks = [ev(11, "gemm", 100, 200, device=CUDA, corr=2), ev(12, "gemm", 200 + gap, 300, device=CUDA, corr=2)]
        out = idle_report([p, op, *ks], ("p",))
        assert "== device idle gaps over 20 us" in out
        assert bool(section(out, "device idle gaps")) is listed, (gap, out)


def test_long_names_are_cut_to_60_characters_for_operators_and_90_for_kernels():
    """Each host operator of a chain shows its first 60 characters, each kernel its first 90 (kernels alike in
    those share a row). [fails if: either width changes]"""
    p = ev(1, "p", 0, 1000, thread=9)
    op = ev(2, "aten::" + "o" * 100, 10, 900)
    ks = [ev(11, "k" * 90 + "_a", 0, 10, device=CUDA, corr=2), ev(12, "k" * 90 + "_b", 100, 110, device=CUDA, corr=2)]
    out = idle_report([p, op, *ks], ("p",))
    assert section(out, "top kernels") == ["     0.02       2  p: " + "k" * 90], out
    assert section(out, "device idle gaps") == ["     0.09      1  p: " + ("aten::" + "o" * 100)[:60]], out


def test_only_gaps_longer_than_min_gap_are_listed():
    """idle_report lists the gaps between kernels longer than min_gap_us, as its docstring and header say: a 20 us
    gap at min_gap_us 20 is not listed, a 21 us one is. [fails if: a gap equal to min_gap_us is counted]"""
    for gap, listed in ((20, False), (21, True)):
        a = ev(1, "phase.a", 0, 1000)
        op = ev(2, "aten::mm", 10, 20, parent=a)
        ks = [ev(11, "gemm", 100, 200, device=CUDA, corr=2), ev(12, "gemm", 200 + gap, 300, device=CUDA, corr=2)]
        out = idle_report([a, op, *ks], ("phase.a",), min_gap_us=20)
        assert bool(section(out, "device idle gaps")) is listed, (gap, out)


def test_busy_time_is_the_union_of_overlapping_kernels():
    """Kernels that overlap (another stream) or touch are one busy stretch: 100-400 with 150-200 inside it and
    400-450 right after is 350 us busy, 0 idle, 3 kernels; touching kernels leave no idle gap even at
    min_gap_us 0. [fails if: merging takes the later span's end instead of the max (busy 150), or busy sums the
    kernels unmerged (400)]"""
    a = ev(1, "phase.a", 0, 1000)
    op = ev(2, "aten::mm", 10, 20, parent=a)
    ks = [ev(11, "gemm", 100, 400, device=CUDA, corr=2), ev(12, "small", 150, 200, device=CUDA, corr=2),
          ev(13, "tail", 400, 450, device=CUDA, corr=2)]
    out = idle_report([a, op, *ks], ("phase.a",), min_gap_us=0)
    assert section(out, "device busy by phase")[0].split() == ["phase.a", "0.35", "0.35", "0.00", "3"]
    assert section(out, "device idle gaps") == [] and "0.00 ms in all" in out


def test_a_gap_is_charged_to_the_innermost_running_operator_up_to_its_grandparent():
    """At the gap's middle (280 us) the latest-starting host event ("brief", 20-30) has ended: the gap goes to the
    innermost one still running ("op", 10-800), named with two enclosing operators and no more (not "root").
    [fails if: the scan back from the latest-starting event stops after one event ("(no host operator)"), or the
    chain's depth is not 3]"""
    root = ev(1, "root", 0, 2000)
    step = ev(2, "step", 1, 1000, parent=root)
    fwd = ev(3, "fwd", 5, 900, parent=step)
    op = ev(4, "op", 10, 800, parent=fwd)
    brief = ev(5, "brief", 20, 30, parent=op)
    late = ev(6, "late", 450, 460, parent=op)
    k1 = ev(11, "k1", 50, 60, device=CUDA, corr=5)
    k2 = ev(12, "k2", 500, 510, device=CUDA, corr=6)
    out = idle_report([root, step, fwd, op, brief, late, k1, k2], ("root",), min_gap_us=20)
    gaps = section(out, "device idle gaps")
    assert len(gaps) == 1 and gaps[0].split()[:2] == ["0.44", "1"], out
    assert gaps[0].endswith("root: op < fwd < step"), gaps


def test_phases_and_rows_are_ordered_by_time_and_an_operator_after_its_phase_is_outside_it():
    """Phases are listed in the order of their first kernel (z.first, -, a.second: not alphabetically) in both
    tables; a phase's kernels by device time, largest first; the gaps by idle time, largest first. An operator
    starting after its phase's span ended (110 us, z.first is 0-100) is outside any phase ("-"), even when the
    annotation's span drawn on the device (20-120) covers it. [fails if: either table is sorted by name, the kernel
    or gap rows ascending, the phase's end is not checked, or device-side annotation spans count as phases]"""
    z = ev(1, "z.first", 0, 100)
    a = ev(2, "a.second", 200, 400)
    drawn = ev(3, "z.first", 20, 120, device=CUDA)
    drawn.is_user_annotation = True
    op1 = ev(4, "aten::small_and_big", 10, 12, parent=z)
    op3 = ev(5, "aten::between", 110, 112)
    op2 = ev(6, "aten::late", 210, 212, parent=a)
    ks = [ev(11, "small", 30, 60, device=CUDA, corr=4), ev(12, "big", 60, 160, device=CUDA, corr=4),
          ev(13, "between_k", 170, 180, device=CUDA, corr=5), ev(14, "late_k", 300, 320, device=CUDA, corr=6)]
    out = idle_report([z, a, drawn, op1, op3, op2, *ks], ("z.first", "a.second"), min_gap_us=5)
    busy = section(out, "device busy by phase")
    assert [r.split()[0] for r in busy] == ["z.first", "-", "a.second"], out
    assert busy[1].split() == ["-", "0.01", "0.01", "0.00", "1"]
    top = section(out, "top kernels")
    assert [r.split(None, 2)[2] for r in top] == ["z.first: big", "z.first: small", "-: between_k",
                                                  "a.second: late_k"], out
    gaps = section(out, "device idle gaps")
    assert [(r.split()[0], r.split()[2]) for r in gaps] == [("0.12", "a.second:"), ("0.01", "-:")], out


def test_only_work_counts_as_a_kernel_not_annotation_spans_drawn_on_the_device():
    """A device event named as a phase (with or without the user-annotation flag) and a user annotation's span of
    any name are not kernels: one kernel counted. [fails if: either the flag check or the phase-name check is
    dropped from _is_kernel]"""
    a = ev(1, "phase.a", 0, 100)
    op = ev(2, "aten::mm", 10, 12, parent=a)
    k = ev(11, "gemm", 20, 60, device=CUDA, corr=2)
    named = ev(12, "phase.a", 20, 90, device=CUDA)  # a phase's name, no flag
    flagged = ev(13, "my.range", 20, 90, device=CUDA)  # flagged, a name that is not a phase
    flagged.is_user_annotation = True
    out = idle_report([a, op, k, named, flagged], ("phase.a",))
    assert [r.split() for r in section(out, "device busy by phase")] == [["phase.a", "0.04", "0.04", "0.00", "1"]], out
    assert [r.split(None, 2)[2] for r in section(out, "top kernels")] == ["phase.a: gemm"]
