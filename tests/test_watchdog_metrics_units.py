"""Unit cases for the peer watchdog's rules, the metrics file, a program's last line, the FLOPs count and the data
preflight, outside the launches that otherwise reach them (from manual mutation testing):

- engine/watchdog.py: $MOE_PEER_TIMEOUT's upper bound, the heartbeat interval, a silent rank (not a finished one)
  after exactly `timeout` seconds, the store answering late or not at all, exit 1 with its one line, the clean
  goodbye (rank 0 serves the store until every other rank is done or silent), no watchdog for a world of one;
- engine/metrics.py: non-finite values in nested rows, rows set aside on a restart, the monitor's events;
- engine/proc.py: the error line handed to a detached writer only for the launcher's own stderr;
- engine/flops.py: ZeRO-3's ds_numel, AutoEP's per-rank experts, the peak table by whole name;
- engine/data_check.py: one step's tokens exactly, the estimate from a sample of many files, NUL bytes, bool answers,
  prompt files with no rows or as .txt, empty files without streaming, a hub split.

The watchdog cases drive a PeerWatchdog built without torch.distributed (a fake store, a fake clock); nothing here
starts a rank.
"""
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import env
from test_data_checks import jsonl

# ----------------------------------------------------------------------------------------------- engine/watchdog.py


class FakeStore:
    """The calls PeerWatchdog makes on its TCPStore, on a dict of counters; `on_read` runs before each multi_get. A
    watchdog still reading after MAX_READS (minutes of its 0.2-1 s polls on the fake clock) would never stop: it fails
    the test instead of hanging the suite."""
    MAX_READS = 10_000

    def __init__(self, on_read=None):
        self.values, self.reads, self.on_read = {}, 0, on_read

    def add(self, key, n):
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]

    def multi_get(self, keys):
        self.reads += 1
        assert self.reads <= self.MAX_READS, f"still polling the store after {self.MAX_READS} reads"
        if self.on_read:
            self.on_read(self)
        return [str(self.values.get(k, 0)).encode() for k in keys]


def bare_watchdog(monkeypatch, rank: int, world: int, timeout: float = 10.0, store=None):
    """A PeerWatchdog as __init__ leaves it (its thread already ended), on a fake store and a clock at 0 that only
    moves when the test moves it (`wd.now[0]`) or the watchdog sleeps."""
    import engine.watchdog as watchdog

    now = [0.0]
    monkeypatch.setattr(watchdog, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                          sleep=lambda s: now.__setitem__(0, now[0] + s)))
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    wd = object.__new__(watchdog.PeerWatchdog)
    wd.rank, wd.world, wd.timeout, wd.interval = rank, world, float(timeout), 1.0
    wd.store = store if store is not None else FakeStore()
    wd.hb = [f"{watchdog.KEY_PREFIX}/hb/{r}" for r in range(world)]
    wd.done = [f"{watchdog.KEY_PREFIX}/done/{r}" for r in range(world)]
    wd.stopping, wd.crashed = threading.Event(), False
    wd.last = {r: (None, 0.0) for r in range(world)}
    wd.thread = threading.Thread(target=lambda: None)
    wd.thread.start()
    wd.thread.join()
    wd.now = now
    return wd


def test_peer_timeout_takes_its_upper_bound_itself(monkeypatch):
    """A week (604800 s) is the largest timeout, accepted; a second more is refused.
    [fails if: the bound is `value < MAX_PEER_TIMEOUT`]"""
    from engine.watchdog import PeerTimeoutError, peer_timeout

    monkeypatch.setenv("MOE_PEER_TIMEOUT", "604800")
    assert peer_timeout() == 604800.0
    monkeypatch.setenv("MOE_PEER_TIMEOUT", "604801")
    with pytest.raises(PeerTimeoutError):
        peer_timeout()


def test_heartbeat_interval_is_a_sixth_of_the_timeout_within_half_a_second_and_5_s(monkeypatch):
    """__init__ on a fake torch.distributed: 12 s -> a beat every 2 s, 1.2 s -> 0.5 s, 60 s -> 5 s; an interval given
    is kept. [fails if: the interval is not timeout / 6, clamped to [0.5, 5]]"""
    import atexit

    import torch.distributed as dist

    import engine.watchdog as watchdog

    class Store(FakeStore):
        def __init__(self, *a, **k):
            super().__init__()

        def wait(self, keys, timeout):
            pass

    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(dist, "TCPStore", Store)
    monkeypatch.setattr(atexit, "register", lambda f: None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    got = []
    for timeout, interval in ((12.0, None), (1.2, None), (60.0, None), (60.0, 0.25)):
        wd = watchdog.PeerWatchdog(timeout, interval)
        wd.close()
        got.append(wd.interval)
    assert got == [2.0, 0.5, 5.0, 0.25]


def test_a_rank_is_stale_only_after_timeout_seconds_of_silence_and_never_once_done(monkeypatch):
    """Rank 0 of 3, timeout 10: at t=0 all beat, at t=5 ranks 0 and 1 beat; at t=10 nobody is late (exactly the
    timeout), at t=12 rank 2 is (12 s silent) and rank 1 is not (7 s since its last beat); a rank marked done is never
    stale. [fails if: a beat does not restart the rank's silence, or a finished rank counts as dead]"""
    wd = bare_watchdog(monkeypatch, rank=0, world=3, timeout=10)
    assert wd._stale([1, 1, 1], [0, 0, 0]) == []
    wd.now[0] = 5.0
    assert wd._stale([2, 2, 1], [0, 0, 0]) == []
    wd.now[0] = 10.0
    assert wd._stale([3, 2, 1], [0, 0, 0]) == []
    wd.now[0] = 12.0
    assert wd._stale([4, 2, 1], [0, 0, 0]) == [2]
    assert wd._stale([4, 2, 1], [0, 0, 1]) == []
    wd.now[0] = 16.0
    assert wd._stale([5, 2, 1], [0, 0, 0]) == [1, 2]


def test_a_beat_reads_the_counters_and_names_the_silent_rank(monkeypatch):
    """_beat on a fake store: it bumps this rank's counter, reads heartbeats and done marks apart, and once rank 1 has
    not moved for over the timeout names it; a store that raises is named with its first line.
    [fails if: _read swaps the heartbeat and done counters]"""
    wd = bare_watchdog(monkeypatch, rank=0, world=2, timeout=10)
    wd.store.add(wd.hb[1], 1)
    assert wd._beat() is None and wd.store.values[wd.hb[0]] == 1
    assert wd._read() == ([1, 1], [0, 0])
    wd.now[0] = 10.5
    assert wd._beat() == "no heartbeat from rank(s) 1 for over 10 s: dead, or its node is unreachable"

    def refused(key, n):
        raise RuntimeError("Connection reset by peer\nC++ trace")

    wd.store.add = refused
    assert wd._beat() == ("the rendezvous store at 10.0.0.7:29500 (rank 0) stopped answering (Connection reset by "
                          "peer)")


def test_a_store_that_never_answers_is_given_up_after_the_timeout(monkeypatch):
    """A beat that blocks (rank 0's node frozen) is left behind after `timeout` seconds, not waited for.
    [fails if: the beat's helper thread is joined for longer than the timeout]"""
    wd = bare_watchdog(monkeypatch, rank=1, world=2, timeout=0.3)
    release = threading.Event()
    monkeypatch.setattr(wd, "_beat", lambda: release.wait(30))
    t0 = time.perf_counter()
    why = wd._beat_in_time()
    took = time.perf_counter() - t0
    release.set()
    assert why == "the rendezvous store at 10.0.0.7:29500 (rank 0) stopped answering (no reply within 0.3 s)"
    assert took < 2.0, took


DIE = """
import sys, threading
from engine.watchdog import PeerWatchdog
wd = object.__new__(PeerWatchdog)
wd.rank, wd.stopping = 1, threading.Event()
if sys.argv[1] == "stopping":
    wd.stopping.set()
wd._die("no heartbeat from rank(s) 0 for over 3 s: dead, or its node is unreachable")
print("went on")
"""


def test_die_ends_the_rank_with_exit_1_and_one_line_unless_it_is_stopping(tmp_path):
    """The watchdog's end of a rank: exit 1 (the launcher then ends the node's other ranks) and one line on stderr;
    while the rank is closing its watchdog (a clean exit in progress) it ends nothing.
    [fails if: _die exits 0, or ends a rank that is already stopping]"""
    runs = {how: subprocess.run([sys.executable, "-c", DIE, how], cwd=tmp_path, env=env(), capture_output=True,
                                text=True, timeout=60) for how in ("running", "stopping")}
    p = runs["running"]
    assert p.returncode == 1 and p.stdout == "", (p.stdout, p.stderr)
    assert p.stderr == ("[rank 1] no heartbeat from rank(s) 0 for over 3 s: dead, or its node is unreachable; ending "
                        "this rank (docs/multinode.md, 'When a node dies')\n")
    p = runs["stopping"]
    assert p.returncode == 0 and p.stdout == "went on\n" and p.stderr == "", (p.stdout, p.stderr)


def test_close_marks_done_and_rank_0_serves_the_store_until_every_rank_is_done(monkeypatch):
    """A clean exit: every rank adds its done mark; rank 0, which serves the store, then reads every 0.2 s until all
    ranks are done (rank 1 here on the 3rd read; both keep beating), or until the rest went silent; a rank that
    crashed marks nothing; a second close does nothing.
    [fails if: rank 0 leaves once any rank is done, another rank serves, or a crashed rank says goodbye]"""
    def rank1_done_on_third_read(store):
        store.add(wd.hb[1], 1)
        if store.reads == 3:
            store.add(wd.done[1], 1)

    wd = bare_watchdog(monkeypatch, rank=0, world=2, store=FakeStore(rank1_done_on_third_read))
    wd.close()
    assert wd.store.reads == 3 and wd.store.values[wd.done[0]] == 1 and wd.now[0] == pytest.approx(0.4)
    wd.close()
    assert wd.store.reads == 3 and wd.store.values[wd.done[0]] == 1

    wd = bare_watchdog(monkeypatch, rank=0, world=2, timeout=1.0)  # rank 1 never beats: silent after 1 s
    wd.close()
    assert wd.store.values[wd.done[0]] == 1 and 1.0 < wd.now[0] < 1.5

    wd = bare_watchdog(monkeypatch, rank=1, world=2)
    wd.close()
    assert wd.store.values == {wd.done[1]: 1} and wd.store.reads == 0

    wd = bare_watchdog(monkeypatch, rank=0, world=2)
    wd.crashed = True
    wd.close()
    assert wd.store.values == {} and wd.store.reads == 0 and wd.stopping.is_set()


def test_no_watchdog_for_a_world_of_one_or_timeout_0_and_one_per_process(monkeypatch):
    """start_peer_watchdog with an initialized process group: none for a world of one, none with timeout 0, and the
    one already started is returned as it is. [fails if: a world of one or timeout 0 starts a watchdog]"""
    import torch.distributed as dist

    import engine.watchdog as watchdog

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setattr(watchdog, "PeerWatchdog", lambda timeout: pytest.fail(f"a watchdog started ({timeout})"))
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    assert watchdog.start_peer_watchdog(30.0) is None
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert watchdog.start_peer_watchdog(0.0) is None
    running = object()
    monkeypatch.setattr(watchdog, "_watchdog", running)
    assert watchdog.start_peer_watchdog(30.0) is running


# ------------------------------------------------------------------------------------------------ engine/metrics.py


def test_non_finite_values_are_null_in_nested_dicts_and_tuples_too():
    """json_line on a row with a dict of phases and a tuple: every NaN/inf inside is null, the rest unchanged.
    [fails if: finite() leaves tuples or nested dicts as they are]"""
    from engine.metrics import json_line

    row = {"step": 2, "phases": {"ref_s": float("nan"), "policy_s": 1.5}, "pair": (float("inf"), 0.25), "ok": True}
    assert json.loads(json_line(row)) == {"step": 2, "phases": {"ref_s": None, "policy_s": 1.5}, "pair": [None, 0.25],
                                          "ok": True}


def metrics_file(run_dir, steps, extra=()) -> None:
    run_dir.mkdir(exist_ok=True)
    rows = [json.dumps({"step": s, "loss": s / 10}) for s in steps] + list(extra)
    (run_dir / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))


def steps_in(path) -> list:
    return [json.loads(line).get("step") if line.startswith("{") else line for line in path.read_text().splitlines()]


def test_rows_past_the_resumed_step_are_set_aside_and_appended_to_earlier_ones(tmp_path, capsys):
    """Resuming from step 4: rows 5 and 6 (written before a crash) move to metrics.replaced.jsonl after what an
    earlier restart put there; row 4 and lines without an integer step stay. Starting over at step 0 moves every row,
    the step-0 one (GRPO's evaluation before training) included.
    [fails if: the resumed step's own row moves, step-0 rows stay on a restart, or earlier set-aside rows are lost]"""
    from engine.metrics import set_aside_later_rows

    run = tmp_path / "run"
    metrics_file(run, [1, 2, 3, 4, 5, 6], extra=["not json", '{"note": "no step"}'])
    (run / "metrics.replaced.jsonl").write_text('{"step": 9}\n')
    set_aside_later_rows(run, 4)
    assert steps_in(run / "metrics.jsonl") == [1, 2, 3, 4, "not json", None]
    assert steps_in(run / "metrics.replaced.jsonl") == [9, 5, 6]
    assert capsys.readouterr().out == (f"note: {run / 'metrics.jsonl'}: 2 rows past step 4, written before this start, "
                                       f"moved to {run / 'metrics.replaced.jsonl'}\n")

    metrics_file(run, [0, 1, 2])
    set_aside_later_rows(run, 0)
    assert steps_in(run / "metrics.jsonl") == [] and steps_in(run / "metrics.replaced.jsonl") == [9, 5, 6, 0, 1, 2]


def test_monitor_events_send_numbers_and_indexed_lists_but_no_bools_or_text():
    """DeepSpeed's monitor gets Train/<key> per number and Train/<key>/<i> per list item, counted from 0.
    [fails if: a bool is sent as a number, or a list's series are numbered from 1]"""
    from engine.metrics import monitor_events

    row = {"step": 7, "loss": 2.5, "skipped": True, "note": "x", "load": [1.0, 2.0, False, "a"], "tokens": 3}
    assert monitor_events(row) == [("Train/loss", 2.5, 7), ("Train/load/0", 1.0, 7), ("Train/load/1", 2.0, 7),
                                   ("Train/tokens", 3, 7)]


def test_a_disabled_monitor_gets_nothing_and_a_piped_row_is_one_line(tmp_path, monkeypatch, capsys):
    """DeepSpeed's monitor object exists with `enabled: false` when the DS config has none: it must not be written
    to. Piped (no terminal, no bar), each logged row is one line on stdout; the row goes to metrics.jsonl.
    [fails if: a monitor is used whatever its `enabled`]"""
    from engine.metrics import Metrics

    monkeypatch.setenv("RANK", "0")
    off = SimpleNamespace(enabled=False, write_events=lambda events: pytest.fail("a disabled monitor was written"))
    sent = []
    on = SimpleNamespace(enabled=True, write_events=sent.append)
    for name, monitor in (("off", off), ("on", on)):
        m = Metrics(tmp_path / name, total_steps=10, monitor=monitor)
        m.log({"step": 1, "loss": 2.0, "lr": 0.001, "grad_norm": 0.5})
        m.close()
        assert steps_in(tmp_path / name / "metrics.jsonl") == [1]
    assert sent == [[("Train/loss", 2.0, 1), ("Train/lr", 0.001, 1), ("Train/grad_norm", 0.5, 1)]]
    assert capsys.readouterr().out.splitlines() == ["step 1 loss 2 lr 0.001"] * 2


# --------------------------------------------------------------------------------------------------- engine/proc.py

def test_print_error_writes_at_once_to_a_captured_stderr_even_under_a_launcher(monkeypatch, capsys):
    """Under the launcher but with sys.stderr replaced (a test's capture, a redirect): the line goes to that stderr,
    now. [fails if: print_error hands the line to the detached writer whenever a launcher is found]"""
    import engine.proc as proc

    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setattr(proc, "launcher_pid", lambda: gone.pid)  # an ended process: a writer would not wait
    monkeypatch.setattr(proc, "LAUNCHER_WAIT_S", 1)
    proc.print_error("error: bad value")
    assert capsys.readouterr().err == "error: bad value\n"


# -------------------------------------------------------------------------------------------------- engine/flops.py


def fake_engine(params: dict) -> SimpleNamespace:
    """An engine whose module holds `params` (name -> numel, or (numel, ds_numel) for a ZeRO-3 partition)."""
    def param(spec):
        numel, ds_numel = spec if isinstance(spec, tuple) else (spec, None)
        p = SimpleNamespace(numel=lambda: numel)
        if ds_numel is not None:
            p.ds_numel = ds_numel
        return p

    named = [(name, param(spec)) for name, spec in params.items()]
    return SimpleNamespace(module=SimpleNamespace(named_parameters=lambda: iter(named)), config={})


def test_flops_count_zero3_partitions_and_autoep_experts_by_hand():
    """By hand: the embedding (1000, ZeRO-3: numel 0, ds_numel 1000) is in the total only; an attention weight (300,
    partitioned the same way) is active; AutoEP's w1 holds 2 of 8 experts per rank (40, ep 4: 160 in all) and a fused
    expert tensor all 8 (160): each active at top-2 / 8 = 40; the output layer (1000) is active.
    total 2620, active 300 + 40 + 40 + 1000 = 1380; attention 3 x 2 layers x 2 x seq 16 x 4 heads x (12 + 8) = 15360;
    FLOPs per token 6 x 1380 + 15360 = 23640.
    [fails if: ds_numel is ignored, AutoEP's experts are not scaled by ep, or E is not n_routed_experts]"""
    from engine.flops import model_flops_per_token

    cfg = SimpleNamespace(n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=4, qk_head_dim=12,
                          v_head_dim=8, hidden_size=32, num_hidden_layers=2)
    engine = fake_engine({"model.embed_tokens.weight": (0, 1000), "model.layers.0.self_attn.q_proj.weight": (0, 300),
                          "model.layers.0.mlp.experts.w1": 40, "model.layers.1.mlp.experts.gate_up_proj": 160,
                          "lm_head.weight": 1000})
    assert model_flops_per_token(engine, cfg, seq_len=16, ep=4) == (23640.0, 2620.0, 1380.0)


def test_peak_table_entries_by_whole_name():
    """Table entries no other test reads, a longer model number that starts like a listed one, and a CPU.
    [fails if: the H100 NVL's peak is wrong, or a name is matched as the start of a longer one (RTX A1000)]"""
    from engine.flops import peak_for_name, peak_tflops

    assert peak_for_name("NVIDIA H100 NVL") == 835.0 and peak_for_name("NVIDIA A800 80GB PCIe") == 312.0
    assert peak_for_name("NVIDIA RTX A1000 6GB Laptop GPU") is None
    assert peak_tflops("cpu") is None


# --------------------------------------------------------------------------------------------- engine/data_check.py


def one_id_per_text(texts):
    """A tokenizer stand-in: one token per text (check_tokens adds one for the EOS between documents)."""
    return {"input_ids": [[7] for _ in texts]}


def test_a_corpus_of_exactly_one_steps_tokens_passes(tmp_path):
    """4 lines of one token each + 4 EOS = 8 tokens = batch 2 x seq_len 4: enough; batch 3 is not (8 < 12).
    [fails if: one step needs more than batch x seq_len tokens]"""
    from engine.config import DataConfig
    from engine.data_check import check_corpus

    (tmp_path / "c.txt").write_text("a\nb\nc\nd\n")
    d = DataConfig(path=str(tmp_path / "c.txt"), seq_len=4)
    assert check_corpus(d, one_id_per_text, 2, 1) == []
    assert check_corpus(d, one_id_per_text, 3, 1) == [
        f"data.path {d.path}: 8 tokens, 2 sequences of data.seq_len 4; one step needs 12 tokens (3 sequences: the DS "
        "config's train_batch_size); add text, or lower data.seq_len or the batch"]


def test_more_files_than_the_sample_are_estimated_from_the_bytes_read(tmp_path):
    """17 files of one 16-byte row: every 2nd file is sampled (9, 144 bytes, 9 x 2 = 18 tokens), so the count is an
    estimate: 18 / 144 x 272 bytes = 34 tokens. [fails if: a partial sample counts as complete, or is not scaled]"""
    from engine.config import DataConfig
    from engine.data_check import check_corpus

    (tmp_path / "d").mkdir()
    for i in range(17):
        (tmp_path / "d" / f"{i:02d}.jsonl").write_text('{"text": "abc"}\n')
    d = DataConfig(path=str(tmp_path / "d"), seq_len=4)
    assert check_corpus(d, one_id_per_text, 100, 1) == [
        f"data.path {d.path}: about 34 tokens (estimated from its first 144 bytes), 8 sequences of data.seq_len 4; "
        "one step needs 400 tokens (100 sequences: the DS config's train_batch_size); add text, or lower data.seq_len "
        "or the batch"]


def test_nul_bytes_are_a_binary_file(tmp_path):
    """Valid UTF-8 that holds a NUL byte is a binary file, named with the offset.
    [fails if: text holding NUL bytes passes]"""
    from engine.config import DataConfig
    from engine.data_check import check_corpus

    (tmp_path / "b.txt").write_bytes(b"ab\x00cd\n")
    assert check_corpus(DataConfig(path=str(tmp_path / "b.txt")), None, None, 1) == [
        f"data.path {tmp_path / 'b.txt'}: holds NUL bytes at offset 2: a binary file, not text"]


def test_a_bool_answer_is_refused_and_a_prompt_file_is_not_told_to_set_text_field(tmp_path):
    """JSON true is no answer (bool is an int in Python); the line's fix is for prompts, not data.text_field.
    [fails if: a bool passes as a number, or the prompt file's line says to set data.text_field]"""
    from engine.config import ConfigError
    from engine.data_check import check_prompt_file

    f = jsonl(tmp_path / "p.jsonl", [{"prompt": "Q: 1 + 1 = ? A:", "answer": True}])
    with pytest.raises(ConfigError) as e:
        check_prompt_file(f, "data.path")
    assert str(e.value) == (f"data.path {f}: row 1 has 'answer' = true, a bool, not a string or number (bad: 1 of the "
                            "1 rows); fix those rows")


def test_prompt_files_with_no_rows_or_as_text_are_refused(tmp_path):
    """Blank lines only (not 0 bytes) are no rows; a .txt file has no prompt/answer columns.
    [fails if: either passes]"""
    from engine.config import ConfigError
    from engine.data_check import check_prompt_file

    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "p.txt").write_text("Q: 1 + 1 = ? A:\n")
    for name, expect in (("blank.jsonl", "no rows; it needs rows with `prompt` and `answer`"),
                         ("p.txt", "a .txt file has one column, text; prompts need `prompt` and `answer` columns (a "
                                   ".jsonl or .parquet file)")):
        with pytest.raises(ConfigError) as e:
            check_prompt_file(str(tmp_path / name), "grpo.eval_path")
        assert str(e.value) == f"grpo.eval_path {tmp_path / name}: {expect}"


def test_an_empty_file_in_a_folder_is_fine_without_streaming(tmp_path):
    """Map-style data reads every file on every rank: an empty one adds nothing and is no problem (only streaming
    hands whole files to ranks). [fails if: an empty file is refused without streaming]"""
    from engine.config import DataConfig
    from engine.data_check import check_corpus

    (tmp_path / "d").mkdir()
    jsonl(tmp_path / "d" / "a.jsonl", [{"text": "one document"}] * 3)
    (tmp_path / "d" / "b.jsonl").write_text("")
    assert check_corpus(DataConfig(path=str(tmp_path / "d")), None, None, 1) == []
    assert check_corpus(DataConfig(path=str(tmp_path / "d"), streaming=True), None, None, 1) == [
        f"data.path {tmp_path / 'd'}: {tmp_path / 'd' / 'b.jsonl'} is empty (1 empty file(s)); streaming hands whole "
        "files to ranks, so remove the empty ones"]


def test_a_hub_dataset_without_the_split_names_its_splits(tmp_path, monkeypatch):
    """data.split checked against the builder's splits (datasets' builder faked: no network).
    [fails if: data.split is not checked against the hub dataset's splits]"""
    import datasets

    from engine.config import DataConfig
    from engine.data_check import check_corpus

    info = SimpleNamespace(features={"text": None}, splits={"train": None, "test": None})
    monkeypatch.setattr(datasets, "load_dataset_builder", lambda path, name=None, **kw: SimpleNamespace(info=info))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # no reachability probe
    monkeypatch.chdir(tmp_path)  # "org/stories" is no local path here
    assert check_corpus(DataConfig(path="org/stories", split="validation"), None, None, 1) == [
        "data.split 'validation' is not a split of org/stories (splits: ['train', 'test']); set data.split"]
    assert check_corpus(DataConfig(path="org/stories", split="test"), None, None, 1) == []


def test_streaming_as_many_rows_as_ranks_passes_and_fewer_are_refused(tmp_path):
    """One file streamed on data-parallel ranks splits its rows (rank r reads rows r, r + ranks, ...): 2 rows on 2
    ranks give each rank one, 3 rows on 4 ranks leave rank 3 none; without streaming every rank reads every row.
    [fails if: rows equal to the ranks are refused, or too few rows pass]"""
    from engine.config import DataConfig
    from engine.data_check import check_corpus

    two = jsonl(tmp_path / "two.jsonl", [{"text": "a"}, {"text": "b"}])
    three = jsonl(tmp_path / "three.jsonl", [{"text": "a"}, {"text": "b"}, {"text": "c"}])
    assert check_corpus(DataConfig(path=two, streaming=True), None, None, 2) == []
    assert check_corpus(DataConfig(path=three, streaming=True), None, None, 4) == [
        f"data.path {three}: 3 rows in 1 file(s); streaming on 4 data-parallel ranks splits rows (rank r reads rows r, "
        "r + ranks, ...), so some rank would get none; add rows, or files in a multiple of the ranks (each rank then "
        "reads its own files)"]
    assert check_corpus(DataConfig(path=three), None, None, 4) == []  # map-style: every rank reads every row


def test_streaming_a_file_whose_first_row_is_longer_than_the_sample_is_not_counted_as_rowless(tmp_path):
    """A first row longer than the 1 MiB sample: its head is read but no row is counted, and the rows after it are
    not seen, so the row count says nothing about how many rows the ranks get: not refused on 2 ranks.
    [fails if: an incomplete sample's row count is taken as the file's]"""
    from engine.config import DataConfig
    from engine.data_check import SAMPLE_BYTES, check_corpus

    f = jsonl(tmp_path / "long.jsonl", [{"text": "x" * (SAMPLE_BYTES + 10)}, {"text": "a"}, {"text": "b"}])
    assert check_corpus(DataConfig(path=f, streaming=True), None, None, 2) == []


def test_an_estimate_from_the_sample_that_reaches_one_step_passes(tmp_path):
    """17 files of one 16-byte row (every 2nd sampled: 18 tokens from 144 bytes, estimated 34 over all 272): one step
    of 5 x 4 = 20 tokens is more than the sample holds but not more than the estimate, so it passes; 9 x 4 = 36 is
    refused. [fails if: the estimate is not compared with one step's tokens before refusing]"""
    from engine.config import DataConfig
    from engine.data_check import check_corpus

    (tmp_path / "d").mkdir()
    for i in range(17):
        (tmp_path / "d" / f"{i:02d}.jsonl").write_text('{"text": "abc"}\n')
    d = DataConfig(path=str(tmp_path / "d"), seq_len=4)
    assert check_corpus(d, one_id_per_text, 5, 1) == []
    assert check_corpus(d, one_id_per_text, 9, 1)[0].startswith(f"data.path {d.path}: about 34 tokens (estimated")


def test_big_files_are_sampled_in_whole_lines_within_the_sample_bytes(tmp_path):
    """Two files of 12288 rows of 64 bytes (768 KiB each, 2 tokens a row with its EOS): each file's head is read to
    half the 1 MiB sample, 8192 whole rows, so the sample is 1048576 bytes and 32768 tokens and the estimate over all
    1572864 bytes is the exact count, 49152: one step of exactly that passes, one more sequence is refused with the
    estimate. [fails if: each file may read the whole sample (2 x 768 KiB read, counted exactly), or the cut to
    whole lines drops the last whole line]"""
    from engine.config import DataConfig
    from engine.data_check import SAMPLE_BYTES, check_corpus

    (tmp_path / "d").mkdir()
    for name in ("a", "b"):
        rows = [json.dumps({"text": f"{i:051d}"}) for i in range(12288)]
        assert {len(r) + 1 for r in rows} == {64}
        jsonl(tmp_path / "d" / f"{name}.jsonl", rows)
    d = DataConfig(path=str(tmp_path / "d"), seq_len=96)
    assert check_corpus(d, one_id_per_text, 512, 1) == []  # 512 x 96 = 49152
    assert check_corpus(d, one_id_per_text, 513, 1) == [
        f"data.path {d.path}: about 49152 tokens (estimated from its first {SAMPLE_BYTES} bytes), 512 sequences of "
        "data.seq_len 96; one step needs 49248 tokens (513 sequences: the DS config's train_batch_size); add text, or "
        "lower data.seq_len or the batch"]


def write_parquet(path, texts) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), path)
    return str(path)


def test_a_small_parquet_file_is_counted_exactly_and_its_rows_split_by_streaming_ranks(tmp_path):
    """A Parquet file read to its end is a complete sample: 3 rows (6 tokens with EOS) are counted, not estimated;
    streamed on 4 ranks its 3 rows leave a rank none. [fails if: a wholly read Parquet file is taken as partly read]"""
    from engine.config import DataConfig
    from engine.data_check import check_corpus

    f = write_parquet(tmp_path / "s.parquet", ["a", "b", "c"])
    assert check_corpus(DataConfig(path=f, seq_len=4), one_id_per_text, 2, 1)[0].startswith(
        f"data.path {f}: 6 tokens, 1 sequences of data.seq_len 4")
    assert check_corpus(DataConfig(path=f, streaming=True), None, None, 4)[0].startswith(
        f"data.path {f}: 3 rows in 1 file(s); streaming on 4 data-parallel ranks")


def test_a_parquet_file_past_the_sample_is_read_to_the_sample_and_estimated_by_its_share(tmp_path):
    """4096 rows of 512 characters (2 MiB of text, 2 tokens a row with its EOS): batches of 1024 rows are read until
    more than the 1 MiB sample is in (3072 rows), and the tokens are scaled by the file's rows read, so the estimate
    is about the true 8192. [fails if: the whole file is read past the sample, or the bytes read are the whole
    file's]"""
    import re

    from engine.config import DataConfig
    from engine.data_check import check_corpus

    f = write_parquet(tmp_path / "big.parquet", [f"{i:08d}" * 64 for i in range(4096)])
    (line,) = check_corpus(DataConfig(path=f, seq_len=100), one_id_per_text, 100, 1)
    m = re.match(rf"data\.path {re.escape(f)}: about (\d+) tokens \(estimated from its first (\d+) bytes\)", line)
    assert m, line
    assert abs(int(m[1]) - 8192) <= 2 and int(m[2]) < os.path.getsize(f), line


def test_a_txt_file_with_another_text_field_is_refused(tmp_path):
    """A .txt file has one column, text: data.text_field set to another name is refused, naming the fix.
    [fails if: the .txt text_field check is dropped]"""
    from engine.config import DataConfig
    from engine.data_check import check_corpus

    (tmp_path / "c.txt").write_text("one line\n")
    assert check_corpus(DataConfig(path=str(tmp_path / "c.txt"), text_field="body"), None, None, 1) == [
        "data.text_field 'body': .txt files have one column, 'text'; set data.text_field: text"]


def test_a_json_document_is_columns_only_when_every_value_is_a_list(tmp_path):
    """One JSON document of lists is a table of columns (2 rows here); a document with a value that is not a list is
    one row, whose list `text` is no string. [fails if: a document with some list values is read as columns]"""
    from engine.config import DataConfig
    from engine.data_check import check_corpus

    (tmp_path / "cols.json").write_text(json.dumps({"text": ["a b", "c d"], "source": ["x", "y"]}, indent=1))
    (tmp_path / "mixed.json").write_text(json.dumps({"text": ["a b", "c d"], "source": "web"}, indent=1))
    assert check_corpus(DataConfig(path=str(tmp_path / "cols.json")), None, None, 1) == []
    (line,) = check_corpus(DataConfig(path=str(tmp_path / "mixed.json")), None, None, 1)
    assert "row 1 has 'text' = " in line and "a list, not a string" in line, line


def test_a_one_row_file_without_a_final_newline_is_checked_as_a_row(tmp_path):
    """A whole file of one row and no final newline is one row like any: one without `text` is refused, one with it
    passes with its text (not the JSON line) as the sample. [fails if: a file read whole is taken for the cut head of
    one long row, and its row is not checked]"""
    from engine.config import DataConfig
    from engine.data_check import check_corpus

    (tmp_path / "bad.jsonl").write_text('{"body": "a b c"}')
    (tmp_path / "ok.jsonl").write_text('{"text": "a b c"}')
    (line,) = check_corpus(DataConfig(path=str(tmp_path / "bad.jsonl")), None, None, 1)
    assert "row 1 has no 'text' (keys: ['body'])" in line, line
    seen = []
    assert check_corpus(DataConfig(path=str(tmp_path / "ok.jsonl"), seq_len=4),
                        lambda texts: seen.extend(texts) or one_id_per_text(texts), 1, 1) == [
        f"data.path {tmp_path / 'ok.jsonl'}: 2 tokens, 0 sequences of data.seq_len 4; one step needs 4 tokens (1 "
        "sequences: the DS config's train_batch_size); add text, or lower data.seq_len or the batch"]
    assert seen == ["a b c"]
