"""bin/pretrain.py, then the trained engine's logits for fixed token ids; started by the real launcher:
    deepspeed --num_gpus N tests/scripts/pretrain_logits.py --ids IDS.pt --logits OUT.pt [--weights W.pt] \\
        [--logits_before B.pt] [bin/pretrain.py args]
It trains exactly as bin/pretrain.py does (engine.pretrain.preflight/build/train: same steps, same checkpoints,
the last one after the last step), then feeds IDS to the same engine in eval mode: a ZeRO forward (every rank), or
the pipeline's eval_batch (the last stage holds the logits). Rank 0 / the last stage saves the logits to OUT; each
rank writes its parameter count to params_rank{r}.json next to OUT. With --weights (ZeRO runs), rank 0 also saves
every parameter and buffer of the engine in full under the engine's names (`gathered`). The engine at that point
holds what the last checkpoint holds, so the logits are those of the checkpoint an export reads (loading a checkpoint
back exactly is tests/test_resume.py's and test_pipeline.py's resume tests). One launch instead of a training launch
plus a loading launch: each launch costs 15-25 s of process start and DeepSpeed init on a 2-core machine.
"""
import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from engine import pipeline, pretrain  # noqa: E402
from engine.parallel import init_distributed, world_from_env  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", required=True)
    ap.add_argument("--logits", required=True)
    ap.add_argument("--weights", help="save the engine's gathered parameters and buffers here (ZeRO runs)")
    ap.add_argument("--logits_before", help="also save the engine's logits before the first step here (ZeRO runs)")
    own, rest = ap.parse_known_args()
    args = pretrain.parse_args(rest)
    world = world_from_env()
    recipe, ds, tok = pretrain.preflight(args, world)
    init_distributed()
    engine, data = pretrain.build(recipe, ds, tok, world)
    ids = torch.load(own.ids)
    if own.logits_before:
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=ids.to(engine.device)).logits
        if world.rank == 0:
            torch.save(logits.float().cpu(), own.logits_before)
        engine.train()
    pretrain.train(recipe, engine, data, tok, world)
    engine.eval()
    with torch.no_grad():
        if pipeline.is_pipeline(ds):
            engine.reset_activation_shape()  # the stages keep training's activation shapes (seq_len) otherwise
            _, hidden = engine.eval_batch(iter([(ids, ids)]), return_logits=True, num_micro_batches=1)
            last = engine.is_last_stage()
            if last:  # the last stage outputs the normed hidden state; its loss applies the output layer
                head = next(f for f in engine.module.forward_funcs if isinstance(f, pipeline.Head))
                logits = head.lm_head(hidden)
        else:
            logits, last = engine(input_ids=ids.to(engine.device)).logits, world.rank == 0
    count = sum(p.numel() for p in engine.module.parameters())
    Path(own.logits).with_name(f"params_rank{world.rank}.json").write_text(json.dumps(count))
    if last:
        torch.save(logits.float().cpu(), own.logits)
    if own.weights:
        weights = gathered(engine)
        if world.rank == 0:
            torch.save(weights, own.weights)
    torch.distributed.barrier()


def gathered(engine) -> dict:
    """Every parameter and buffer of a ZeRO engine in full, under the engine's names: ZeRO-3 partitions gathered
    (a no-op under ZeRO-1/2), each AutoEP layer's local experts all-gathered over its expert-parallel group, in that
    group's rank order (the global expert order of AutoEP's default, contiguous placement)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    ep_groups = {f"{path}.experts.{w}": m.ep_group_name for path, m in engine.module.named_modules()
                 if getattr(m, "_is_autoep_layer", False) for w in ("w1", "w2", "w3")}
    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            t = p.data.detach().clone()
        if name in ep_groups:
            group = groups._get_expert_parallel_group(ep_groups[name])
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t, group=group)
            t = torch.cat(parts)
        out[name] = t
    out.update({name: b.detach().clone() for name, b in engine.module.named_buffers()})
    return out


if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown
    exit_now(main())
