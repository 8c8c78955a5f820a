"""bin/bench.py runs unchanged on 2 ranks and counts the same model the same way with and without AutoEP."""
import json

from conftest import ROOT, ZERO3, launch

BENCH = ROOT / "bin" / "bench.py"


def test_bench_two_ranks_and_baseline_agree_on_model_size(tmp_path):
    out = tmp_path / "bench.jsonl"
    launch(2, BENCH, "--deepspeed_config", ZERO3, "--steps", "2", "--warmup", "1", "--out", out, cwd=tmp_path)
    p = launch(1, BENCH, "--deepspeed_config", ZERO3, "--steps", "2", "--warmup", "1", "--out", out,
               "--no_autoep", cwd=tmp_path)
    auto, plain = [json.loads(line) for line in out.read_text().splitlines()]
    assert (auto["world"], auto["ep"], auto["autoep"]) == (2, 2, True)
    assert (plain["world"], plain["ep"], plain["autoep"]) == (1, 1, False)
    # AutoEP's w1/w2/w3 (E/ep experts per rank) and HF's fused experts (all E) are the same parameters.
    assert auto["params_m"] == plain["params_m"] and auto["active_m"] == plain["active_m"]
    assert auto["active_m"] < auto["params_m"]
    assert auto["tokens_per_s_per_gpu"] > 0 and 0 < auto["mfu"] < 1
    assert "tokens_per_s_per_gpu" in p.stdout  # the table
