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
