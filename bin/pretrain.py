#!/usr/bin/env python3
"""Pretrain a MoE LM. Start with the DeepSpeed launcher:
    deepspeed --num_gpus 2 bin/pretrain.py --deepspeed_config ds_configs/zero3.json [--config RECIPE.yaml]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from engine.pretrain import main  # noqa: E402

if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown
    exit_now(main())
