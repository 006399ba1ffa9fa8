"""What the test launcher's fork server also imports in sessions that run the slow tier (tests/conftest.py):
transformers and the test models' modules, which every rank of a Hugging Face job (model.type=hf, HF
tokenizers) would otherwise import again, seconds each."""
import transformers  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401
from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
