"""Optimizer steps with finite and non-finite gradients on the tiny ZeRO-2 engine (engine.parallel.one_overflow_check);
started as `deepspeed --num_gpus N tests/scripts/overflow_steps.py OUT_DIR`. Each step's loss is scaled by a factor
on one rank only (the last), the others keep 1: whether the weights changed, the skipped-step count and the global
norm after each step go to OUT_DIR/rank{r}.json, with the metrics row's fields for it. The steps: finite; NaN; inf;
NaN and finite again with DeepSpeed's own per-tensor check put back."""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from engine.auto_batch import AutoBatch  # noqa: E402
from engine.config import load_recipe  # noqa: E402
from engine.data import load_tokenizer  # noqa: E402
from engine.ds_config import read_ds_config, resolve_ds_config  # noqa: E402
from engine.parallel import init_distributed, world_from_env  # noqa: E402
from engine.metrics import json_line  # noqa: E402
from engine.pretrain import build, grad_stats  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    world = world_from_env()
    r = load_recipe(None, {"train.compile": False, "run_dir": str(out / "run")})
    ds = resolve_ds_config(read_ds_config(ROOT / "ds_configs" / "zero2.json"), r, world_size=world.size,
                           ranks_per_node=world.size, auto_batch=AutoBatch())
    init_distributed()
    engine, data = build(r, ds, load_tokenizer(r.data.tokenizer), world)
    opt = engine.optimizer
    dropped = "check_overflow" in vars(opt)
    ids = next(data.micro_batches(2, world.rank, world.size))[1]
    weights = lambda: [p.detach().float().clone() for p in engine.module.parameters()]  # noqa: E731
    rows = []
    for scale in (1.0, float("nan"), float("inf"), "deepspeed", float("nan"), 1.0):
        if scale == "deepspeed":
            del opt.check_overflow  # DeepSpeed's own per-tensor check from here on
            continue
        before = weights()
        mine = scale if world.rank == world.size - 1 else 1.0
        engine.backward(engine(input_ids=ids, labels=ids).loss * mine)
        engine.step()
        rows.append({"scale": str(scale), "changed": any(not torch.equal(a, b) for a, b in zip(before, weights())),
                     "skipped_steps": engine.skipped_steps, "norm": str(engine.get_global_grad_norm()),
                     "norm_value": float(engine.get_global_grad_norm()),
                     "row": json.loads(json_line(grad_stats(engine)))})  # what a metrics row says of the step
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{world.rank}.json").write_text(json.dumps({"dropped": dropped, "steps": rows}))


if __name__ == "__main__":
    main()
