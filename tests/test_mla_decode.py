"""grpo.decode_attention triton: DeepSeek's latent attention at each decode step as one Triton kernel
(engine/mla_decode.py). On a CPU in Triton's interpreter (fp32) where the triton package is installed (torch's CUDA
wheels bring it; the CPU build does not, so CI skips these two), on a GPU compiled (bf16 and fp32)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, env, run_in_process

CHECK = ROOT / "tests" / "scripts" / "mla_decode_check.py"
triton_missing = pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"),
                                    reason="no triton package (torch's CPU build ships without it)")


def check(device: str) -> dict:
    extra = {"TRITON_INTERPRET": "1"} if device == "cpu" else {}
    p = subprocess.run([sys.executable, CHECK, "--device", device], cwd=ROOT, env={**env(), **extra},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def assert_decoders_agree(res: dict, tol: float) -> None:
    for arch, d in res["decoder"].items():
        assert d["layers"] == 3, (arch, d)  # every MLA layer went through the kernel's path
        assert d["tokens_equal"] and d["logp_diff"] < tol, (arch, d)  # the same 12 sampled tokens, log-probs alike
        assert d["logp_diff"] > 0, (arch, d)  # ... computed another way: the kernel did run


@triton_missing
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the compiled kernel is checked (the next test); the "
                    "GPU image's Triton interpreter fails on a numpy scalar conversion the compiled kernel never makes")
def test_the_kernel_and_a_decoder_with_it_match_torch_in_the_interpreter():
    """fp32: the kernel equals softmax attention to rounding (heads, slots and widths off the block sizes, a row
    with no visible slot, strided cache rows, bool / additive / batch-broadcast masks); a 3-layer DeepSeek-V3 and
    V2 decoder with it in every layer samples the same 12 tokens as without it."""
    res = check("cpu")
    assert all(v < 1e-5 for v in res["kernel_fp32"].values()), res
    assert_decoders_agree(res, 1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel: on a GPU only")
def test_the_compiled_kernel_matches_torch_on_cuda():
    """bf16 within bf16's rounding of the output (2^-8 relative), fp32 (full-precision dots) to 1e-5."""
    res = check("cuda")
    assert all(v < 1e-5 for v in res["kernel_fp32"].values()), res
    assert all(v < 2 ** -7 for v in res["kernel_bf16"].values()), res
    assert_decoders_agree(res, 1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_triton_decode_attention_off_cuda_is_one_line_before_any_work(tmp_path, capfd, monkeypatch):
    from engine.grpo import main

    import yaml

    recipe = yaml.safe_load((ROOT / "engine" / "recipes" / "grpo_tiny.yaml").read_text())  # bin/grpo.py's default
    recipe["grpo"].update(decode_attention="triton", rollout="local", allow_random_init=True)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    p = run_in_process(main, ["--deepspeed_config", str(ROOT / "ds_configs" / "zero3_grpo.json"), "--config",
                              str(tmp_path / "r.yaml"), "--run_dir", str(tmp_path / "run")], capfd,
                       monkeypatch, cwd=ROOT)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "grpo.decode_attention: triton runs on CUDA devices only; use auto or torch" in lines[0], p.stderr
    assert not (tmp_path / "run").exists()
    assert os.environ.get("TRITON_INTERPRET") is None
