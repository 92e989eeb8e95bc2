from setuptools import find_packages, setup

setup(
    name="torchscale-fairseq",
    version="0.1.0",
    description="Magneto/DeepNorm backbones, X-MoE, SparseClip and tensor model parallelism as a fairseq plugin",
    packages=find_packages(include=["torchscale_fairseq", "torchscale_fairseq.*"]),
    package_data={"torchscale_fairseq.interop": ["hf_modeling/*.py"]},
    # Floors only: the newest releases are tested by scripts/compat_matrix.sh (README, "Supported
    # versions"), and an upper bound goes here only beside the failure of a release known to break.
    # Python 3.10 would need stock fairseq 0.12.2, whose pins (hydra-core<1.1, omegaconf<2.1) carry
    # metadata pip >= 24.1 rejects: it no longer installs.
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.11",
        "numpy>=1.26",
        "fairseq-fixed==0.12.3.1",
        "sentencepiece",
        "tiktoken",
        "sacrebleu",
    ],
    extras_require={
        # torchao: --fp8 (emulated on the CPU); triton: --ts-fused-master-step's kernel in Triton's interpreter
        # (CUDA builds of torch bring their own triton)
        "test": ["pytest", "pytest-xdist>=3", "ruff", "torchao==0.17.0", "triton>=3.6"],
        "plots": ["matplotlib"],
        "export": ["transformers>=5.0.0", "safetensors>=0.8", "tokenizers"],
    },
    entry_points={"console_scripts": [
        "ts-reshard = torchscale_fairseq.cli.reshard:main",
        "ts-consolidate-experts = torchscale_fairseq.cli.consolidate_experts:main",
        "ts-plot-logs = torchscale_fairseq.cli.plot_logs:main",
        "ts-export-hf = torchscale_fairseq.cli.export_hf:main",
        "ts-import-torchscale = torchscale_fairseq.cli.import_torchscale:main",
    ]},
)
