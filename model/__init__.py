"""The decoder-only transformer. Knows nothing about distribution (tests/test_model.py checks)."""
from .config import ModelConfig
from .documents import Documents
from .transformer import DecoderBlock, Transformer, initial_value

__all__ = ["ModelConfig", "Documents", "DecoderBlock", "Transformer", "initial_value"]
