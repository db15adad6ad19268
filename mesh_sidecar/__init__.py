"""mesh-inference: run one GGUF model across several machines with llama.cpp RPC over QUIC."""

__version__ = "0.1.0"
