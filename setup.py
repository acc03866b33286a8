"""batchmax_tp: high-throughput batched LLM inference with KV-cache eviction during prefill and decoding."""

from setuptools import find_packages, setup

setup(
    name="batchmax_tp",
    version="0.1.0",
    description=(
        "Batch-Max: higher LLM throughput with larger batch sizes and KV-cache compression during prefill and decoding"
    ),
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["batchmax_tp", "batchmax_tp.*"]),
    package_data={"batchmax_tp": ["fixtures/*.jsonl", "fixtures/*/*.jsonl", "fixtures/*/*.json"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=5.17,<5.25",  # tested: 5.17 (scripts/gpu_env_check.sh, the GPU machine's) and 5.24
        "deepspeed",
        "sentencepiece",
        "datasets",
        "rouge-score",
        "gguf",
        "accelerate",
        "pyyaml",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "ruff", "lm-eval>=0.4.13,<0.5"],  # ruff: lint + format (pyproject.toml)
        "mpi": ["mpi4py"],
        "lm_eval": ["lm-eval>=0.4.13,<0.5"],  # the ``batchmax`` model for lm-evaluation-harness (batchmax_tp.harness)
    },
    entry_points={
        # lm-eval 0.4.13 discovers no outside model: this script registers ``batchmax`` and runs lm-eval's CLI.
        "console_scripts": ["batchmax-lm-eval = batchmax_tp.harness:main"],
        # Newer lm-eval discovers models from this group (its docs/plugins.md).
        "lm_eval.models": ["batchmax = batchmax_tp.harness:BatchMaxLM"],
    },
)
