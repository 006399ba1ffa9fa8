"""A model's own Hugging Face tokenizer (`data.tokenizer: hf`) behind the small SentencePiece-like surface
the preparation uses: encode, eos_id, get_piece_size, save, fingerprint.

transformers is imported only when one is built, so data/ needs it only for this tokenizer. Each
preparation worker process builds its own from the folder.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


class HFTokenizer:
    def __init__(self, path: str | Path):
        # Our workers are the parallelism: one Rust thread pool per process would oversubscribe the cores.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer

        self.path = Path(path)
        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self.tok.eos_token_id is None:
            raise ValueError(f"tokenizer in {path} has no EOS token; documents need one as separator")
        self.fingerprint = f"hf:{tokenizer_files_digest(self.path)}"

    def encode(self, texts: list[str], out_type=int, num_threads: int = 1) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def eos_id(self) -> int:
        return self.tok.eos_token_id

    def get_piece_size(self) -> int:
        return len(self.tok)

    def save(self, path: Path) -> None:
        self.tok.save_pretrained(str(path))


def tokenizer_files_digest(folder: Path) -> str:
    """sha256 over the tokenizer files of a model folder (names and contents), not its weights."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and "token" in p.name):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()
