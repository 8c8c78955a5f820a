"""2 CPU ranks against 1 rank: ZeRO-3 partitions, expert-parallel slices,
peak memory while building, disjoint data, and equal parameters after training on the same global batch.
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, launch, run_ranks, write_ds

PROBE = ROOT / "tests" / "scripts" / "probe.py"
RECIPE = """
model: {arch: deepseek_v3, hidden_size: 128, num_layers: 4, num_heads: 4, intermediate_size: 256,
        moe_intermediate_size: 128, num_experts: 8, experts_per_token: 2, num_shared_experts: 1,
        vocab_size: 512, max_position_embeddings: 512}
data: {seq_len: 32}
train: {max_steps: 3, warmup_steps: 1, log_every: 1, balance_rate: 0.001}
"""
# For the memory bound: 8 layers, so the one MoE layer AutoEP holds whole is small beside the model.
BIG = """
model: {arch: deepseek_v3, hidden_size: 512, num_layers: 8, num_heads: 4, intermediate_size: 512,
        moe_intermediate_size: 1024, num_experts: 8, experts_per_token: 2, num_shared_experts: 1,
        vocab_size: 512, max_position_embeddings: 512}
data: {seq_len: 32}
"""


def probe_job(tmp, name: str, ranks: int, micro: int, recipe: str, *extra, leaf="auto") -> tuple:
    """The job of tests/scripts/probe.py for `name` (for conftest.run_ranks / launch); `leaf`: the DS config's
    zero_optimization.leaf_module (None: no such key, DeepSpeed's hooks on every module)."""
    d = tmp / name
    d.mkdir()
    (d / "recipe.yaml").write_text(recipe)
    # fp32 so that 2 ranks vs 1 differ only by summation order, not by bf16 rounding; no persistence
    # threshold, so ZeRO-3 keeps no small parameter whole on every rank.
    ds = write_ds(d / "ds.json", drop=("bf16",), train_micro_batch_size_per_gpu=micro)
    cfg = json.loads(ds.read_text())
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    cfg["zero_optimization"]["leaf_module"] = leaf
    if leaf is None:
        del cfg["zero_optimization"]["leaf_module"]
    ds.write_text(json.dumps(cfg))
    return (ranks, PROBE, "--out", d / "out", "--deepspeed_config", ds, "--config", d / "recipe.yaml",
            "--run_dir", d / "run", *extra)


def probed(tmp, name: str, ranks: int) -> list[dict]:
    return [json.loads((tmp / name / "out" / f"rank{r}.json").read_text()) for r in range(ranks)]


def probe(tmp, name: str, ranks: int, micro: int, recipe: str, *extra, leaf="auto") -> list[dict]:
    """A training probe (conftest.run_ranks: 2 ranks on the rank pool, 1 in this process); a memory probe
    (--build_only: peak RSS since the process started) is a launch of its own."""
    job = probe_job(tmp, name, ranks, micro, recipe, *extra, leaf=leaf)
    (launch if "--build_only" in extra else run_ranks)(*job, cwd=tmp / name)
    return probed(tmp, name, ranks)


SEEN = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_ranks")
    shm_before = shm_buffers()
    # Same global batch: 1 rank x micro-batch 2 == 2 ranks x micro-batch 1.
    one = probe(tmp, "one", 1, 2, RECIPE)
    SEEN["one_big"] = probe(tmp, "one_big", 1, 2, BIG, "--build_only")  # for the memory test (a launch)
    # 2 ranks with each decoder layer's forward compiled (ZeRO-3 with leaves, train.compile: true) against 1 eager rank
    two = probe(tmp, "two", 2, 1, RECIPE.replace("train: {", "train: {compile: true, "))
    SEEN["per_module"] = probe(tmp, "per_module", 1, 2, RECIPE, leaf=None)  # DeepSpeed's default hooks
    params = {n: torch.load(tmp / n / "out" / "params.pt") for n in ("one", "two", "per_module")}
    SEEN["shm_left"] = shm_buffers() - shm_before
    return one, two, params


def shm_buffers() -> set:
    return {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}


def test_no_shared_memory_all_reduce_op_and_no_dev_shm_files(runs):
    """engine/parallel.py: skip_cpu_shm_op. DeepSpeed's CPU shared-memory all-reduce op is neither built (52 s on a
    new 2-core machine) nor loaded, on 1 rank and on 2; so no rank creates its 66 MiB /dev/shm buffer, which DeepSpeed
    never removes (CI once ran out of memory on them). Checked in every rank while it runs and after the runs."""
    one, two, _ = runs
    for info in one + two:
        assert info["shm_op"] is False and info["shm_files"] == [], info["shm_files"]
    assert SEEN["shm_left"] == set()


def test_each_rank_holds_half_of_every_dense_parameter(runs):
    _, two, _ = runs
    for info in two:
        dense = {n: p for n, p in info["params"].items() if ".experts." not in n}
        assert dense
        for name, p in dense.items():
            # ZeRO-3 pads each partition up to a multiple of the world size.
            assert p["full"] <= 2 * p["local"] <= p["full"] + 2, (name, p)


def test_each_rank_holds_half_of_the_routed_experts(runs):
    one, two, _ = runs
    for name, p1 in one[0]["params"].items():
        if ".experts." not in name:
            continue
        for info in two:
            p2 = info["params"][name]
            assert p2["shape"][0] * 2 == p1["shape"][0] == 8, (name, p1, p2)
            assert p2["shape"][1:] == p1["shape"][1:]


def test_ranks_read_disjoint_data_covering_the_set(runs):
    one, two, _ = runs
    n = one[0]["num_sequences"]
    a, b = set(two[0]["epoch_sequences"]), set(two[1]["epoch_sequences"])
    assert not a & b
    assert a | b == set(range(n)) == set(one[0]["epoch_sequences"])
    # Same global order on 1 and 2 ranks: rank r of 2 reads every other sequence of the 1-rank order.
    assert one[0]["epoch_sequences"][0::2] == two[0]["epoch_sequences"]


def test_two_ranks_train_to_the_same_parameters_as_one(runs):
    """... the 2 ranks with their decoder layers compiled (train.compile: true under ZeRO-3 with decoder-layer leaves:
    DeepSpeed's gathers and releases around each compiled layer, a parameter's storage changing between steps)."""
    one, two, params = runs
    assert [info["compiled_layers"] for info in two] == [4, 4] and one[0]["compiled_layers"] == 0
    assert np.allclose(one[0]["losses"], two[0]["losses"], rtol=1e-5)
    assert one[0]["losses"][-1] < one[0]["losses"][0] - 0.5  # it trained: parameters moved
    assert_same_parameters(params["one"], params["two"])


def test_the_routing_biases_stay_equal_on_every_rank(runs):
    """train.balance_rate: each rank routes its own data, and the bias update uses the loads summed over the ranks,
    so both ranks hold the same biases after every step, those of the 1-rank run on the same global batch (to one
    update step of 0.001 where a near-tie routed a token differently); and they moved."""
    one, two, _ = runs
    b0, b1, ref = two[0]["biases"], two[1]["biases"], one[0]["biases"]
    assert b0 and b0 == b1  # exactly: an update from one rank's own loads would differ here
    assert any(any(v != 0 for v in b) for b in b0.values())
    assert max(abs(x - y) for n in ref for x, y in zip(ref[n], b0[n])) <= 0.001 + 1e-9


def assert_same_parameters(p1: dict, p2: dict) -> None:
    """Two fp32 runs' trained parameters that differ only by rounding: summation order (reduce-scatter over 2 ranks
    vs a local sum, the order autograd adds a tensor's gradient contributions) or inductor's fused kernels, ~1e-7
    relative in each gradient. Adam divides by sqrt(v), which can amplify that for elements whose gradients are
    tiny, so a few elements drift up to a few 1e-5 after 3 steps. 1e-4 is 30x below one step's update size at lr
    3e-3: a wrong shard, a swapped expert or a skipped sample would move elements by ~lr and fail."""
    assert p1.keys() == p2.keys()
    worst = max((p1[k] - p2[k]).abs().max().item() for k in p1)
    mean = np.mean([(p1[k] - p2[k]).abs().mean().item() for k in p1])
    assert worst < 1e-4, worst
    assert mean < 1e-6, mean


def test_zero3_hooks_whole_decoder_layers_and_trains_as_with_a_hook_per_module(runs):
    """The shipped ZeRO-3 files' leaf_module "auto": ZeRO-3 hooks each decoder layer as one leaf (gathered, released
    and reduced whole) and nothing inside it; the same training on one rank as DeepSpeed's default, a hook on every
    module (the 2-rank runs above use the leaves too)."""
    one, _, params = runs
    per_module = SEEN["per_module"]
    layers = [f"model.layers.{i}" for i in range(4)]
    leaf_hooked = [n for n in one[0]["hooked_modules"] if n.startswith("model.layers.")]
    assert leaf_hooked == layers, leaf_hooked
    inside = [n for n in per_module[0]["hooked_modules"] if n.startswith("model.layers.0.")]
    assert len(inside) > 10, inside  # attention's projections and norms, AutoEP's router and experts, ...
    assert np.allclose(one[0]["losses"], per_module[0]["losses"], rtol=1e-6)
    # The hooks' autograd nodes change the order in which autograd sums a tensor's gradient contributions (a layer's
    # input feeds the residual, the norm, the router, the experts and the shared experts): rounding only.
    assert_same_parameters(params["one"], params["per_module"])


def test_no_rank_holds_the_whole_model_while_building(runs, tmp_path):
    one = SEEN["one_big"]  # built by the runs fixture, beside its 1-rank training run
    two = probe(tmp_path, "two", 2, 1, BIG, "--build_only")
    full_mb = sum(p["full"] * p["bytes_per_elem"] for p in one[0]["params"].values()) / 2**20
    grow1 = one[0]["rss_after_autoep_mb"] - one[0]["rss_before_build_mb"]
    for info in two:
        grow2 = info["rss_after_autoep_mb"] - info["rss_before_build_mb"]
        # Peak RSS growth from the start of the build until AutoEP has re-partitioned the experts (before
        # ZeRO allocates optimizer state). Measured: ~340 MiB on each of 2 ranks, ~566 MiB on 1 rank, for a
        # 437 MiB model; the ~120 MiB beyond half the model is fixed overhead (lazy imports, DeepSpeed
        # buffers) plus the one MoE layer AutoEP holds whole while it swaps it.
        assert grow2 < full_mb, (grow2, full_mb)
        assert grow2 < 0.75 * grow1, (grow2, grow1)


def test_streaming_ranks_read_disjoint_documents_covering_the_set(tmp_path):
    """Streaming mode: each rank reads its own files of a 4-file folder; together, every document once."""
    lines = (ROOT / "engine" / "assets" / "corpus.jsonl").read_text().splitlines()[:400]
    data = tmp_path / "docs"
    data.mkdir()
    for i in range(4):
        (data / f"part{i}.jsonl").write_text("\n".join(lines[i::4]) + "\n")
    recipe = RECIPE.replace("data: {seq_len: 32}", f"data: {{seq_len: 32, streaming: true, path: {data}}}")
    two = probe(tmp_path, "two", 2, 1, recipe)
    a, b = two[0]["epoch_docs"], two[1]["epoch_docs"]
    assert len(a) == len(b) == 200
    assert not set(a) & set(b)
    all_docs = {hashlib.md5(json.loads(line)["text"].encode()).hexdigest() for line in lines}
    assert set(a) | set(b) == all_docs
