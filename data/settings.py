"""The data section of the config (data.*): each setting declared once, with the docstring the configuration reference
shows (config/sections.py builds the tree from it), and every check of the data settings on their own, as a list of
problems that the config's validation and data/prepare.py both report. What a check compares with other sections
(model.max_seq_len, model.reset_positions) is in config/checks.py; the choices of the Literal fields are the config
loader's one choice check."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .remote import TIMEOUT_S, url_problem
from .store import META_NAME, DataFormat, data_format, format_problem, read_record

# Waits longer than about 31 years are "never" in practice; the process group's store and time.sleep count
# in int64 nanoseconds and overflow at 2**63 ns (292 years).
MAX_SECONDS = 10**9
DEFAULT_SEED = 1234  # run.seed's default, which also decides the validation split of a preparation


@dataclass
class SourceConfig:
    """One entry of data.sources."""

    path: str = ""
    """A folder prepared by scripts/prepare_data.py."""
    weight: float = 1.0
    """Its share of the training samples, relative to the other sources' weights."""


@dataclass
class HFDatasetConfig:
    """data.hf_dataset: a Hugging Face dataset as the corpus, read offline with the datasets library (docs/data.md)."""

    path: str = ""
    """A save_to_disk folder, a folder of the dataset's parquet/jsonl files (a hub snapshot), or a dataset name
    (org/name) in the local caches; empty: data.files is the corpus. The text is in column data.text_field."""
    name: str = ""
    """The dataset's configuration (load_dataset's name); empty: its default."""
    split: str = "train"
    """The split to prepare."""
    streaming: bool = True
    """Read a folder of data files as a stream, in one pass, without first converting it into the datasets cache
    (a save_to_disk folder and a cached name are read from their memory-mapped files either way)."""

    def record(self) -> dict:
        """What decides the prepared data (streaming only decides how it is read)."""
        return {"path": self.path, "name": self.name, "split": self.split}


@dataclass
class DataConfig:
    files: list[str] = field(default_factory=list)
    """.txt, .jsonl, .json.gz/.jsonl.gz, .jsonl.zst/.json.zst and .parquet files, folders of them and glob
    patterns, local or URLs (s3://, gs:// with folders and globs; http(s):// files; docs/data.md); empty means
    the built-in corpus, data.builtin_corpus (or data.hf_dataset)."""
    builtin_corpus: Literal["stdlib", "python"] = "stdlib"
    """The corpus when data.files and data.hf_dataset are empty, read from this interpreter's files (no download):
    stdlib (the standard library's .py sources) or python (those and the .py sources of every installed package,
    in site-packages; docs/data.md)."""
    hf_dataset: HFDatasetConfig = field(default_factory=HFDatasetConfig)
    sources: list[SourceConfig] = field(default_factory=list)
    """Train on a mixture of prepared folders instead of data.files: [{path: DIR, weight: 0.7}, ...], all made
    with the same tokenizer; samples are drawn from each in proportion to its weight (docs/data.md)."""
    dataset_dir: str = ""
    """The prepared folder (tokenizer and token shards): written by scripts/prepare_data.py, or by the training
    job itself for data.files up to data.max_in_job_mb; empty means data/cache/<fingerprint of the data settings>."""
    tokenizer_model: str = ""
    """An existing SentencePiece .model to use instead of training one."""
    tokenizer: Literal["sentencepiece", "hf"] = "sentencepiece"
    """sentencepiece (train one, or data.tokenizer_model) or hf (a Hugging Face tokenizer: data.hf_tokenizer, or
    model.hf_path's own)."""
    hf_tokenizer: str = ""
    """data.tokenizer=hf: a local folder with a Hugging Face tokenizer (e.g. the Llama model imported for
    model.init_from); empty: model.hf_path's."""
    vocab_size: int = 4096
    """Vocabulary size of the SentencePiece model trained on the corpus."""
    val_fraction: float = 0.02
    """Share of documents held out for validation, chosen by a hash of each document's text."""
    max_corpus_mb: float = 0.0
    """Read at most this many MB of the (uncompressed) corpus, logging where it stops (0: all of it)."""
    max_document_mb: float = 64.0
    """Longest document (MB of text) preparation holds, which bounds its memory: a longer .txt line is cut
    into documents of this size; a longer .jsonl line or parquet value is a bad record (data.on_bad_record).
    At least one byte (1/1048576)."""
    text_field: str = "text"
    """The .jsonl field, or parquet column, that holds each document's text."""
    on_bad_record: Literal["error", "skip"] = "error"
    """A .jsonl line that is not JSON or lacks the text field, a null parquet value, or text that is not UTF-8:
    error (stop, naming the file and line or row) or skip (count them and report the first)."""
    num_workers: int = 0
    """Processes that parse and tokenise the corpus in parallel (0: one per CPU core, or none for a corpus
    under 16 MB; never more than the CPU cores preparation may run on); the output is the same for any number."""
    shard_tokens: int = 100_000_000
    """Training tokens per shard file of the prepared folder (a shard closes at the first work unit past it)."""
    max_in_job_mb: float = 1024.0
    """train_fsdp.py prepares data.files itself only up to this many MB, on disk and of text read; larger corpora
    are prepared beforehand with scripts/prepare_data.py (0: no limit)."""
    remote_timeout_s: float = TIMEOUT_S
    """URLs in data.files: seconds a server may take to accept a connection, or between two parts of its answer,
    before the request fails as a network error (retried, docs/data.md)."""
    prepare_wait_s: float = 7200.0
    """How long the other ranks wait for rank 0 to prepare data inside the job before giving up."""
    seq_len: int = 256
    """Tokens per training sample."""
    document_masking: bool = False
    """Inside a packed window of data.seq_len tokens, each token attends only to its own document (documents are
    joined by EOS; the token after an EOS starts a new one), through FlexAttention's block-sparse kernel;
    model.type=hf: through transformers' packed-sequence mask, with model.reset_positions (docs/training.md)."""
    format: DataFormat = "text"
    """text (documents: every token is trained on) or chat (fine-tuning: .jsonl conversations or prompt/response
    pairs, rendered by a chat template; only the assistant's tokens are trained on, docs/training.md)."""
    messages_field: str = "messages"
    """data.format=chat: the field holding a record's list of messages ({role: system|user|assistant, content})."""
    prompt_field: str = "prompt"
    """data.format=chat: in a record without data.messages_field, the field holding the prompt (the user's turn)."""
    response_field: str = "response"
    """data.format=chat: in a record without data.messages_field, the field holding the response (trained on)."""
    chat_template: Literal["auto", "plain"] = "auto"
    """data.format=chat: auto (the tokenizer's own chat template with data.tokenizer=hf, ours otherwise) or plain
    (ours, for any tokenizer: <|user|>, <|assistant|> headers and an <|end|> marker, docs/training.md)."""

    def problems(self) -> list[str]:
        """Every problem of the data settings on their own, one line each naming the setting."""
        p = [] if self.seq_len > 0 else [f"data.seq_len must be positive, got {self.seq_len}"]
        if not 0 < self.val_fraction < 1:
            p.append(f"data.val_fraction must be between 0 and 1, got {self.val_fraction}")
        if self.vocab_size < 16 and not self.tokenizer_model:
            p.append(f"data.vocab_size must be at least 16, got {self.vocab_size}")
        p += [f"data.{name} must not be negative, got {getattr(self, name)}"
              for name in ("max_corpus_mb", "num_workers", "max_in_job_mb") if getattr(self, name) < 0]
        p += [f"data.{name} must be positive, got {getattr(self, name)}"
              for name in ("shard_tokens", "prepare_wait_s") if getattr(self, name) <= 0]
        if not self.max_document_mb * 2**20 >= 1:  # a smaller bound leaves no byte of a document to read
            p.append(f"data.max_document_mb must be at least one byte ({1 / 2**20:.3g} MB), got {self.max_document_mb}")
        if not self.text_field:
            p.append("data.text_field must name the field or column holding the text")
        return p + self._format_problems() + self._corpus_problems() + self._url_problems()

    def _format_problems(self) -> list[str]:
        p = [f"data.{name} must name a field of the records" for name in ("messages_field", "prompt_field",
                                                                         "response_field") if not getattr(self, name)]
        if self.format == "chat" and not (self.files or self.dataset_dir or self.sources or self.hf_dataset.path):
            p.append("data.format=chat needs data.files (.jsonl conversations) or a prepared data.dataset_dir")
        meta_path = Path(self.dataset_dir) / META_NAME
        if self.dataset_dir and meta_path.is_file():
            found = data_format(read_record(meta_path))
            if (problem := format_problem(self.dataset_dir, found, self.format)) is not None:
                p.append(f"data.format={self.format}: {problem}")
        return p

    def _corpus_problems(self) -> list[str]:
        """One corpus named (data.files, data.sources or data.hf_dataset), and the folders of data.sources."""
        p: list[str] = []
        if self.sources:
            if self.files or self.dataset_dir:
                p.append("data.sources replaces data.files and data.dataset_dir: leave those empty (--data.files=[])")
            from .mixture import source_problems  # reads the folders' meta.json; imports torch, so only when needed

            p += source_problems([(s.path, s.weight) for s in self.sources], wanted_format=self.format)
        hf = self.hf_dataset
        if self.builtin_corpus != "stdlib" and (self.files or self.sources or hf.path):
            p.append(f"data.builtin_corpus={self.builtin_corpus} is the corpus only when data.files, data.sources and "
                     f"data.hf_dataset.path are empty: leave it at stdlib, or empty them")
        if hf.path and (self.files or self.sources):
            p.append("data.hf_dataset.path and data.files (or data.sources) both name a corpus: give one of them")
        elif given := [f"data.hf_dataset.{name}" for name, default in (("name", ""), ("split", "train"))
                       if not hf.path and getattr(hf, name) != default]:
            p.append(f"{' and '.join(given)} without data.hf_dataset.path: name the dataset")
        return p

    def _url_problems(self) -> list[str]:
        """URLs in data.files of a scheme not read, of a form refused (credentials in it, a host that does not parse)
        or whose package is not installed; data.remote_timeout_s."""
        p = [problem for entry in self.files if (problem := url_problem(entry))]
        if not 0 < self.remote_timeout_s <= MAX_SECONDS:
            p.append(f"data.remote_timeout_s must be in (0, 10**9] seconds, got {self.remote_timeout_s}")
        return p
