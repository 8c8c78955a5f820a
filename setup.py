from setuptools import find_packages, setup

setup(
    name="moe-engine",
    version="0.1.0",
    description="DeepSpeed-native pretraining and GRPO for Mixture-of-Experts language models",
    packages=find_packages(include=["engine", "engine.*"]),
    package_data={"engine": ["assets/*.jsonl", "assets/tokenizer/*", "recipes/*.yaml"]},
    scripts=["bin/pretrain.py", "bin/grpo.py", "bin/zero_to_fp32", "bin/bench.py", "bin/check_cluster",
             "bin/make_default_assets.py"],
    python_requires=">=3.10",
    install_requires=[
        "torch==2.13.0",           # pinned: a fresh machine installs a known build (CPU here, CUDA on GPU hosts)
        "deepspeed==0.19.8",       # AutoEP + ZeRO-3 together, as the engine uses them (tested with this release)
        "transformers>=5.17,<5.18",  # tested with AutoEP; 5.24 breaks it (_CanRecordRegistry.get() TypeError)
        "accelerate>=1.1",         # transformers' DeepSpeed integration (HfDeepSpeedConfig) requires it
        "datasets>=5.2,<6",
        "pyyaml>=6",
    ],
    # xdist: the suite on both CI cores; pytest < 9.1: from 9.1 pytest builds test ids itself and xdist 3.8's
    # --dist loadgroup tags are lost (tests/conftest.py: pytest_configure refuses such a pytest with -n)
    # fp8: train.fp8 (engine/fp8.py) through torchao's Float8Linear; the tests run it emulated on the CPU, so the test
    # extra carries it too. 0.18.0 needs torch >= 2.11 (its import checks): the pinned 2.13 and the GPU image's 2.11.
    extras_require={"test": ["pytest>=8,<9.1", "pytest-xdist>=3.6", "torchao==0.18.0"],
                    "fp8": ["torchao==0.18.0"]},
)
