"""Test probe, started by the real `deepspeed` launcher: builds and trains exactly as bin/pretrain.py does
(engine.pretrain.preflight/build/train), and records what the tests check:
  - peak RSS growth while building the model and swapping in AutoEP layers (--build_only: stop there)
  - per parameter: full size vs what this rank holds (ZeRO-3 partition / expert-parallel slice)
  - the modules ZeRO-3 hooks (leaf modules: zero_optimization.leaf_module)
  - which global sequences this rank reads over one epoch (map-style) or which documents (streaming)
  - after training, the full gathered parameters (rank 0 writes them)
  - whether DeepSpeed loaded its CPU shared-memory all-reduce op, and this rank's /dev/shm buffer of it if any
usage: deepspeed --num_gpus N tests/scripts/probe.py --out DIR --deepspeed_config ... [pretrain args]
"""
import hashlib
import json
import os
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ctypes  # noqa: E402

if "--build_only" in sys.argv:
    # Freed blocks of 64 KiB or more go back to the OS at once (glibc's M_MMAP_THRESHOLD = -3), so RSS tracks live
    # memory; only the memory probes (a fresh process each) pay its page faults, not every run of the suite.
    ctypes.CDLL(None).mallopt(-3, 65536)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine import pretrain  # noqa: E402
from engine.data import PackedSequences  # noqa: E402
from engine.parallel import init_distributed, world_from_env  # noqa: E402


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak so far, MiB (Linux: KiB)


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    argv = [a for i, a in enumerate(sys.argv[1:]) if a not in ("--out", "--build_only") and sys.argv[i] != "--out"]
    args = pretrain.parse_args(argv)
    world = world_from_env()
    recipe, ds, tok = pretrain.preflight(args, world)
    init_distributed()
    rank = world.rank
    info: dict = {"rank": rank}
    import deepspeed.comm.comm as ds_comm

    info["shm_op"] = getattr(ds_comm.cdb, "shm_comm_op", None) is not None
    info["shm_files"] = sorted(p.name for p in Path("/dev/shm").glob(
        f"deepspeed_allreduce_buffer_{os.getuid()}_*_{os.environ['MASTER_PORT']}_{rank}"))

    # Peak memory while building: ru_maxrss is a running maximum, so reading it right after AutoEP has
    # swapped the MoE layers (before ZeRO allocates optimizer state) bounds everything since the build began.
    from deepspeed.runtime.engine import DeepSpeedEngine
    original = DeepSpeedEngine._configure_expert_parallel

    def measured(self, *a, **k):
        result = original(self, *a, **k)
        info["rss_after_autoep_mb"] = rss_mb()
        return result

    build_model = pretrain.build_model

    def build_model_measured(*a, **k):
        import gc
        gc.collect()
        info["rss_before_build_mb"] = rss_mb()
        return build_model(*a, **k)

    DeepSpeedEngine._configure_expert_parallel = measured
    pretrain.build_model = build_model_measured
    engine, data = pretrain.build(recipe, ds, tok, world)
    DeepSpeedEngine._configure_expert_parallel = original
    pretrain.build_model = build_model

    params = {}
    for name, p in engine.module.named_parameters():
        full = int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()
        # What this rank holds outside forward/backward: its partition, plus the whole tensor if ZeRO-3
        # keeps it gathered (params under stage3_param_persistence_threshold).
        local = int(p.ds_tensor.numel()) + p.data.numel() if hasattr(p, "ds_tensor") else p.numel()
        params[name] = {"full": full, "local": local, "shape": list(p.ds_shape if hasattr(p, "ds_shape") else p.shape),
                        "bytes_per_elem": p.element_size()}
    info["params"] = params
    # The modules ZeRO-3 put its hooks on (DeepSpeed gives each an id): with leaf modules not those inside them.
    info["hooked_modules"] = [n for n, m in engine.module.named_modules() if hasattr(m, "ds_id")]
    # decoder layers whose forward is compiled (train.compile: true under ZeRO-3: pretrain.compile_layers)
    info["compiled_layers"] = sum(hasattr(layer.forward, "_torchdynamo_orig_callable")
                                  for layer in engine.module.get_decoder().layers)

    out.mkdir(parents=True, exist_ok=True)
    if "--build_only" in sys.argv:
        (out / f"rank{rank}.json").write_text(json.dumps(info))
        return
    micro = engine.train_micro_batch_size_per_gpu()
    if isinstance(data, PackedSequences):
        n = len(data)
        epoch = []
        j = 0
        while True:
            pos = [g for g in data.rank_positions(j, micro, rank, world.size) if g < n]
            if not pos:
                break
            epoch += [data.global_index(g) for g in pos]
            j += 1
        info["epoch_sequences"] = epoch
        info["num_sequences"] = n
    else:
        data.docs.set_epoch(0)
        info["epoch_docs"] = [hashlib.md5(r[recipe.data.text_field].encode()).hexdigest() for r in data.docs]

    rows = pretrain.train(recipe, engine, data, tok, world)
    info["losses"] = [r["loss"] for r in rows]
    info["biases"] = {n: b.tolist() for n, b in engine.module.named_buffers() if n.endswith("e_score_correction_bias")}

    import deepspeed
    gathered = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            t = p.data.detach().clone().float()
        ep = ds.get("expert_parallel", {}).get("autoep_size", 1)
        if ".experts." in name and ep > 1:
            assert ep == world.size, "the probe gathers experts only when expert parallel spans the world"
            parts = [torch.empty_like(t) for _ in range(world.size)]
            dist.all_gather(parts, t)  # rank r holds experts [r*E/ep, (r+1)*E/ep)
            t = torch.cat(parts, dim=0)
        gathered[name] = t
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(info))
    if rank == 0:
        torch.save(gathered, out / "params.pt")
    dist.barrier()


if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown
    exit_now(main())
