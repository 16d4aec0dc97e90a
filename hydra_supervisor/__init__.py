"""hydra: supervise stock llama.cpp binaries (llama-server, ggml-rpc-server) on GPUs and hosts."""

__version__ = "0.1.0"
