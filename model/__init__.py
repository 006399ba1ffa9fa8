"""The decoder-only transformer. Knows nothing about distribution (tests/test_model.py checks)."""
from .config import ModelConfig
from .transformer import DecoderBlock, Transformer, initial_value

__all__ = ["ModelConfig", "DecoderBlock", "Transformer", "initial_value"]
