"""A model's own Hugging Face tokenizer (`data.tokenizer: hf`) behind the small SentencePiece-like surface
the preparation uses: encode, eos_id, get_piece_size, save, fingerprint.

transformers is imported only when one is built, so data/ needs it only for this tokenizer. Each
preparation worker process builds its own from the folder."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .jsonfile import read_json_file
from .store import read_tokenizer_file


class HFTokenizer:
    def __init__(self, path: str | Path):
        # Our workers are the parallelism: one Rust thread pool per process would oversubscribe the cores.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer

        self.path = Path(path)
        # First: it reads each tokenizer file as every tokenizer is read, refusing a FIFO or a file past the size
        # bound before transformers would block on it or read it whole (without a folder, transformers says why).
        digest = tokenizer_files_digest(self.path) if self.path.is_dir() else ""
        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as err:  # transformers' own text spans lines and advises trust_remote_code
            if names_own_code(self.path, "tokenizer_config.json") or names_own_code(self.path, "config.json"):
                raise ValueError("it needs the folder's own Python code (auto_map), which is never run; "
                                 "use a tokenizer that transformers includes") from None
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            raise ValueError(f"{type(err).__name__}: {lines[0] if lines else ''}") from None
        if self.tok.eos_token_id is None:
            raise ValueError(f"tokenizer in {path} has no EOS token; documents need one as separator")
        self.fingerprint = f"hf:{digest}"

    def encode(self, texts: list[str], out_type=int, num_threads: int = 1) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def eos_id(self) -> int:
        return self.tok.eos_token_id

    def get_piece_size(self) -> int:
        return len(self.tok)

    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def render_chat(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """(token ids, mask of the assistant's tokens) with the tokenizer's own chat template (data/chat.py)."""
        from .chat import TemplateNotIncremental, render_template

        if not self.tok.is_fast:  # the assistant's characters are mapped to tokens by the fast tokenizer's offsets
            raise TemplateNotIncremental(f"the tokenizer in {self.path} is not a fast (Rust) tokenizer; set "
                                         "data.chat_template=plain")
        return render_template(self.tok, messages)

    def save(self, path: Path) -> None:
        self.tok.save_pretrained(str(path))


def tokenizer_files_digest(folder: Path) -> str:
    """sha256 over the tokenizer files of a model folder (names and contents), not its weights. Whatever else stands
    under such a name (a FIFO, a device) is refused: UnsafePath, an OSError."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if "token" in p.name and p.exists() and not p.is_dir()):
        digest.update(path.name.encode() + read_tokenizer_file(path))
    return digest.hexdigest()


def names_own_code(folder: Path, json_name: str) -> bool:
    """Whether a model folder's config.json or tokenizer_config.json points transformers at Python files of the
    folder (`auto_map`), which it would import: code from a model folder is never run here."""
    try:
        return bool(read_json_file(folder / json_name).get("auto_map"))
    except (OSError, ValueError, AttributeError):  # no such file (a DataError), not JSON, or not an object
        return False
