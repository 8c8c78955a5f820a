#!/usr/bin/env python3
"""GRPO on a pretrained MoE. Start with the DeepSpeed launcher:
    deepspeed bin/grpo.py --deepspeed_config ds_configs/zero3.json --init_from runs/tiny
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from engine.grpo import main  # noqa: E402

if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown
    exit_now(main())
