"""looped: looped language models whose KV-cache is shared across recurrences."""

import setuptools

setuptools.setup(
  name="looped",
  version="0.1.0",
  description="Looped (recurrent-depth) LMs with KV-sharing across recurrences (BeNice!).",
  packages=setuptools.find_packages(
    include=["looped", "looped.*", "configs", "pallas_kernels", "pallas_kernels.*"]
  ),
  package_data={
    "looped.sim": ["traces_data/*.jsonl", "traces_data/*.md"],
    # The looped family's PyTorch modeling code, copied into every export folder.
    "looped.convert": ["hf_looped/*.py"],
  },
  python_requires=">=3.10",
  install_requires=[
    "jax>=0.6",
    "flax>=0.10",
    "optax>=0.2.4",
    "orbax-checkpoint>=0.11",
    "grain>=0.2.10",
    "ml-collections>=1.0",
    "tensorflow-datasets>=4.9.7",
    "array-record>=0.7",  # tfds.data_source reads array_record without TensorFlow.
    "chex>=0.1.88",
    "absl-py>=2.1",
    "sentencepiece>=0.2",  # optional tokenizer, small wheel.
    "tensorboardX>=2.6",  # TensorBoard event files without TensorFlow.
    "matplotlib>=3.8",  # PNG plots of evaluations and simulations.
    "fastapi>=0.110",  # The HTTP server (configs/serve.py): routing, streaming responses.
    "uvicorn>=0.30",  # Its ASGI server.
    "safetensors>=0.4",  # Reads imported checkpoints' weights (looped/convert), numpy API.
    "tokenizers>=0.15",  # Imported checkpoints' own tokenizer.json (data.tokenizer='huggingface').
    "jinja2>=3.1",  # Renders chat templates (/v1/chat/completions), in transformers' environment.
  ],
  extras_require={
    "test": [
      "pytest>=8",
      "pytest-xdist>=3.5",
      "ruff>=0.6",
      "nbclient>=0.10",  # Executes colabs/*.ipynb in tests/colabs_test.py.
      "nbformat>=5.10",
      "ipykernel>=6.29",  # The notebooks' kernel: this environment's Python.
      "openai>=1.0",  # tests/server_test.py drives the server with OpenAI's client.
      "schemathesis>=4.0",  # tests/server_fuzz_test.py fuzzes the server from its OpenAPI doc.
      "hypothesis>=6.100",  # Property tests of the request parser (and schemathesis' engine).
      "filelock>=3.12",  # tests/conftest.py: jax's lock on the run's shared compilation cache.
      # tests/server_chat_test.py compares the server's chat templates with transformers' own
      # apply_chat_template (its tokenizers only: no torch).
      "transformers>=4.57",
    ],
    "tensorboard": ["tensorboard>=2.15"],  # The viewer for WORKDIR/tensorboard/ event files.
    # launch/xm_launch.py: XManager (~600 MB of cloud clients installed; pins protobuf<7).
    "launch": ["xmanager>=0.7"],
    # Runs a looped-family export (looped/convert/hf_looped) in transformers, and its tests
    # (tests/convert_hf_looped_test.py); never needed to train or serve.
    "hf": ["torch>=2.4", "transformers>=4.57", "jinja2>=3.1"],
  },
)
