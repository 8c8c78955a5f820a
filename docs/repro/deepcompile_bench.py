#!/usr/bin/env python3
"""bin/bench.py under DeepCompile (ZeRO-3), with the scheduler fix from deepcompile_scatter_add.py applied first.

    deepspeed --num_gpus 1 docs/repro/deepcompile_bench.py --deepspeed_config ds_configs/zero3.json \
        --config engine/recipes/deepseek_2b6.yaml --ds_set compile.deepcompile=true --steps 6 --warmup 8 --out x.jsonl

The engine does not compile under ZeRO-3 (DeepSpeed refuses compile.autoep_non_moe there); this measuring script
makes it call engine.compile() on the whole model, which with compile.deepcompile hands the graph to DeepCompile.
An experiment, not an engine path.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bin"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402
import deepcompile_scatter_add  # noqa: E402
from engine import parallel, pretrain  # noqa: E402

if __name__ == "__main__":
    deepcompile_scatter_add.fix_scheduler()
    pretrain.wants_compile = lambda recipe, ds: True  # engine.compile(): DeepCompile takes the whole model
    pretrain.compile_outside_autoep = lambda module: []
    parallel.compiles_parameter_free = lambda ds, train: False
    sys.exit(bench.main())
