"""relaxspec: exact and relaxed speculative decoding for visual autoregressive models."""

__version__ = "0.1.0"
