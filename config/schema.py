"""The one typed config tree: YAML in, `--section.key=value` overrides on top, validated as a whole.

Every problem (unknown key, wrong type, impossible value) is collected and reported together before any
process group starts, each naming the field and, for unknown names, the closest valid one.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from model import ModelConfig

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NONE")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective", "selective_op", "selective_op_lean", "auto")
FLOAT8 = ("none", "tensorwise", "rowwise")
LR_SCHEDULES = ("cosine", "wsd", "constant")
DECAY_SHAPES = ("linear", "1-sqrt")
# train.lora.targets: one name per projection of a Llama-style block, and the groups of them.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
LORA_GROUPS = {"attention": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down"), "all": LORA_TARGETS}
TRACKERS = ("tensorboard", "wandb", "mlflow")
# Seeds reach numpy's generators (non-negative) and signed 64-bit keys of the data order.
MAX_SEED = 2**63 - 1
# Waits longer than about 31 years are "never" in practice; the process group's store and time.sleep count
# in int64 nanoseconds and overflow at 2**63 ns (292 years).
MAX_SECONDS = 10**9
# A config file is a few kilobytes: a file far larger is a checkpoint or a corpus given in its place.
MAX_CONFIG_BYTES = 16 * 2**20
# Anchors and aliases may repeat a few sections; more than this many repeated values is an attack.
MAX_ALIAS_VALUES = 10_000
# A config nests four levels (section, key, list, mapping); YAML's composer recurses once per level.
MAX_NESTING = 64


class ConfigError(ValueError):
    """Raised with every problem found, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass
class RunConfig:
    name: str = "run"
    """Run name; the default output directory is checkpoints/<name>, so one folder name (no '/', not '..')."""
    output_dir: str = ""
    """Where config.yaml, metrics.jsonl, tensorboard/ and checkpoints go; empty means checkpoints/<name>."""
    seed: int = 1234
    """Seed for the initial weights and the data order (the same on every rank); 0 to 2**63 - 1."""
    device: str = "auto"
    """auto (CUDA when available, else CPU), cuda or cpu."""
    timeout_s: int = 600
    """Collective timeout: a hung rank ends the job with an error after this many seconds (at most 10**9)."""
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"])
    """Signals that mean 'save a checkpoint after this step and exit 0' (preemption, Slurm's pre-termination
    signal, Ctrl-C); a second one aborts at once without saving."""
    preemption_grace_s: float = 120.0
    """After a stop signal, exit non-zero if the checkpoint is not saved within this many seconds (positive, at
    most 10**9)."""


@dataclass
class ModelSection(ModelConfig):
    """The `model` section: our Transformer's dimensions, or a Hugging Face causal LM."""

    type: str = "llama"
    """llama: our DecoderBlock transformer (the dimensions above); hf: a transformers causal LM."""
    hf_path: str = ""
    """model.type=hf: a local folder with a pretrained model (config.json + weights); nothing is downloaded."""
    hf_config: str = ""
    """model.type=hf without weights: a config.json (or a folder holding one) to build with random init."""
    init_from: str = ""
    """Start from the weights of this checkpoint (a full .pth, a sharded folder, or scripts/import_hf.py's output)
    with a fresh optimizer at step 0; its model must have this section's dimensions (max_seq_len may differ). A run
    that resumes (checkpoint.auto_resume, --resume_from) continues from its own checkpoint instead."""
    reset_positions: bool = False
    """Rotary positions restart at 0 at each document of a packed window (the token after an EOS starts one),
    instead of counting across the window. model.type=hf: goes with data.document_masking (transformers finds
    the documents from the restarting positions), so both are on or both off (docs/training.md)."""


@dataclass
class SourceConfig:
    """One entry of data.sources."""

    path: str = ""
    """A folder prepared by scripts/prepare_data.py."""
    weight: float = 1.0
    """Its share of the training samples, relative to the other sources' weights."""


@dataclass
class DataConfig:
    files: list[str] = field(default_factory=list)
    """.txt, .jsonl, .json.gz/.jsonl.gz, .jsonl.zst/.json.zst and .parquet files, folders of them and glob
    patterns; empty means the Python standard library sources."""
    sources: list[SourceConfig] = field(default_factory=list)
    """Train on a mixture of prepared folders instead of data.files: [{path: DIR, weight: 0.7}, ...], all made
    with the same tokenizer; samples are drawn from each in proportion to its weight (docs/data.md)."""
    dataset_dir: str = ""
    """The prepared folder (tokenizer and token shards): written by scripts/prepare_data.py, or by the training
    job itself for data.files up to data.max_in_job_mb; empty means data/cache/<fingerprint of the data settings>."""
    tokenizer_model: str = ""
    """An existing SentencePiece .model to use instead of training one."""
    tokenizer: str = "sentencepiece"
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
    on_bad_record: str = "error"
    """A .jsonl line that is not JSON or lacks the text field, a null parquet value, or text that is not UTF-8:
    error (stop, naming the file and line or row) or skip (count them and report the first)."""
    num_workers: int = 0
    """Processes that parse and tokenise the corpus in parallel (0: one per CPU core, or none for a corpus
    under 16 MB; never more than the CPU cores preparation may run on); the output is the same for any number."""
    shard_tokens: int = 100_000_000
    """Training tokens per shard file of the prepared folder (a shard closes at the first work unit past it)."""
    max_in_job_mb: float = 1024.0
    """train_fsdp.py prepares data.files itself only up to this many MB on disk; larger corpora are prepared
    beforehand with scripts/prepare_data.py (0: no limit)."""
    prepare_wait_s: float = 7200.0
    """How long the other ranks wait for rank 0 to prepare data inside the job before giving up."""
    seq_len: int = 256
    """Tokens per training sample."""
    document_masking: bool = False
    """Inside a packed window of data.seq_len tokens, each token attends only to its own document (documents are
    joined by EOS; the token after an EOS starts a new one), through FlexAttention's block-sparse kernel;
    model.type=hf: through transformers' packed-sequence mask, with model.reset_positions (docs/training.md)."""
    format: str = "text"
    """text (documents: every token is trained on) or chat (fine-tuning: .jsonl conversations or prompt/response
    pairs, rendered by a chat template; only the assistant's tokens are trained on, docs/training.md)."""
    messages_field: str = "messages"
    """data.format=chat: the field holding a record's list of messages ({role: system|user|assistant, content})."""
    prompt_field: str = "prompt"
    """data.format=chat: in a record without data.messages_field, the field holding the prompt (the user's turn)."""
    response_field: str = "response"
    """data.format=chat: in a record without data.messages_field, the field holding the response (trained on)."""
    chat_template: str = "auto"
    """data.format=chat: auto (the tokenizer's own chat template with data.tokenizer=hf, ours otherwise) or plain
    (ours, for any tokenizer: <|user|>, <|assistant|> headers and an <|end|> marker, docs/training.md)."""


@dataclass
class LoRAConfig:
    """train.lora: low-rank adapters on the blocks' linear layers, the base model frozen (docs/training.md)."""

    rank: int = 0
    """Rank r of each adapter (0: LoRA off, every weight trains)."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on an adapter's input (training only), in [0, 1)."""
    targets: list[str] = field(default_factory=lambda: ["all"])
    """Which projections get adapters: q, k, v, o, gate, up, down, or the groups attention (q, k, v, o), mlp
    (gate, up, down) and all. Our model's fused wqkv and w13 weights get one adapter per chosen slice; a
    Hugging Face model's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj and down_proj layers one each."""


@dataclass
class TrainConfig:
    max_steps: int = 1000
    """Optimizer steps to run."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all ranks; gradient accumulation is derived from it."""
    micro_batch_size: int | str = 8
    """Sequences per forward pass on each rank, or auto: the largest divisor of the per-rank batch
    (global_batch_size / world size) that fits in GPU memory, measured by a few trial steps before
    training and cached in <output_dir>/microbatch_cache.json (the training is the same: same global batch)."""
    auto_micro_batch_margin: float = 0.1
    """micro_batch_size=auto: share of the GPU's memory left free (fragmentation, evaluation, the unforeseen)."""
    auto_micro_batch_cpu: int = 8
    """micro_batch_size=auto on the CPU (no GPU memory to measure): the largest divisor of the per-rank batch up to
    this."""
    oom_retry_half: bool = False
    """On a CUDA out-of-memory error in a step or an evaluation (every rank alike), redo it with half the
    micro-batch and twice the accumulation (the same samples), and keep that size; off: stop with the figures."""
    lr: float = 3e-4
    """Peak learning rate, reached after warmup."""
    lr_schedule: str = "cosine"
    """After warmup: cosine (down to the floor at max_steps), wsd (warmup-stable-decay: lr until the final
    decay_fraction of max_steps, then down to the floor; a resume with a larger max_steps keeps the stable phase
    going) or constant (lr to the end). A pure function of the step: a resume continues it exactly
    (docs/training.md)."""
    decay_fraction: float = 0.2
    """lr_schedule=wsd: the final decay's share of max_steps, in (0, 1]; the decay starts at step
    max_steps - round(decay_fraction * max_steps) and its last step runs at the floor."""
    decay_shape: str = "linear"
    """lr_schedule=wsd: the final decay's shape, linear or 1-sqrt (lr falls with 1 - sqrt(progress): fast first,
    then slowly)."""
    min_lr: float | None = None
    """The floor that cosine and wsd decay to, absolute (at most lr). Give this or min_lr_ratio, not both."""
    min_lr_ratio: float | None = None
    """The floor as a fraction of lr, in [0, 1]; neither this nor min_lr given: 0.1."""
    warmup_steps: int = 100
    """Linear warmup steps (every schedule), at most max_steps (wsd: leaving room for its decay)."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not norms)."""
    beta1: float = 0.9
    """AdamW first-moment decay, in [0, 1)."""
    beta2: float = 0.95
    """AdamW second-moment decay, in [0, 1)."""
    max_bad_steps: int = 0
    """Non-finite loss or gradient norm: skip up to this many such steps, then stop (0: stop at the first)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all shards) to this; 0 disables."""
    eval_interval: int = 100
    """Compute the validation loss every this many steps (and at the end); 0 disables."""
    eval_batches: int = 8
    """Validation micro-batches per evaluation, in total (split over the ranks: the same data at any world size)."""
    eval_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks (names, or task .yaml files) run with the validation at every eval_interval, on
    all ranks with the model as it trains (sharded), each metric logged next to val_loss as eval/<task>/<metric>;
    needs the lm-eval package (docs/evaluation.md). Empty: none."""
    eval_tasks_path: list[str] = field(default_factory=list)
    """Folders of your own lm-eval task .yaml files (lm-eval's include_path), searched before its built-in tasks."""
    eval_tasks_limit: int = 0
    """Documents per task in train.eval_tasks (the first ones; 0: all)."""
    precision: str = "auto"
    """auto (bf16 where supported, else fp16 on GPU; fp32 on CPU), bf16, fp16 or fp32."""
    compile: bool = False
    """torch.compile each DecoderBlock."""
    compile_tuning: bool = False
    """With train.compile: inductor's coordinate-descent tuning of the compiled kernels' launch configurations
    (block sizes, warps), timed on this GPU at the first compile and cached on the machine. For long runs: somewhat
    faster kernels for a longer compile at every start, longer again where the auto search compiles its trials
    (docs/benchmarks.md). The choice is timed, as inductor's default choice among its reduction kernels already is:
    a resume on the same machine (its cache) continues bit for bit, one elsewhere within rounding.
    scripts/benchmark.py compiles its reference the same way."""
    float8: str = "none"
    """FP8 matmuls in the blocks' linear layers through torchao (an optional package: the torchao release
    built for the installed torch): none, tensorwise (one scale per tensor; FP8 all-gather of the weights)
    or rowwise (one scale per row). Needs fsdp.version 2 and a GPU of compute capability 8.9 or later (Ada, Hopper).
    Weights, optimizer state and checkpoints stay in full precision."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA fine-tuning: {rank, alpha, dropout, targets}; rank 0 (the default) trains every weight."""
    loss_chunk_tokens: int = 0
    """Compute output logits, loss and their gradients this many tokens at a time (0: all at once).
    The (tokens x vocab) fp32 logits never exist at once: their memory saved at the same speed
    (docs/benchmarks.md)."""

    @property
    def resolved_min_lr_ratio(self) -> float:
        """The schedule's floor as a fraction of lr: from min_lr, else min_lr_ratio, else 0.1."""
        if self.min_lr is not None:
            return self.min_lr / self.lr
        return 0.1 if self.min_lr_ratio is None else self.min_lr_ratio


@dataclass
class FSDPConfig:
    version: int = 1
    """1: FullyShardedDataParallel (default); 2: fully_shard."""
    sharding_strategy: str = "FULL_SHARD"
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD."""
    hybrid_shard_group_size: int = 0
    """HYBRID_SHARD: ranks per shard group (0: GPUs per node, LOCAL_WORLD_SIZE), a divisor of the world size;
    groups of 1 rank run as NO_SHARD over the whole world, one group of every rank as FULL_SHARD."""
    backward_prefetch: str = "BACKWARD_PRE"
    """BACKWARD_PRE, BACKWARD_POST or NONE."""
    forward_prefetch: bool = False
    """Issue the next block's all-gather before the current forward finishes (FSDP1)."""
    limit_all_gathers: bool = True
    """Rate-limit all-gathers so memory stays bounded (FSDP1)."""
    cpu_offload: bool = False
    """Keep sharded parameters and gradients in CPU memory (GPU only)."""
    use_orig_params: bool = True
    """Expose the original parameters (needed by torch.compile and per-parameter weight decay)."""
    sync_module_states: bool = False
    """Broadcast rank 0's weights at wrap time (for weights loaded on rank 0 only)."""
    activation_checkpointing: str = "none"
    """none; full (every DecoderBlock keeps only its input); selective (full, on every
    ac_every_n_layers-th block); selective_op (every block keeps its matmul and attention outputs and
    recomputes the elementwise ops); selective_op_lean (selective_op, but the feed-forward's gate and up
    outputs, the largest, are recomputed too: much less memory for about half the forward's matmuls again);
    auto (on GPUs: trial steps measure none, selective_op, selective_op_lean, selective and full with the
    micro-batch search, and the pair of policy and micro-batch with the most tokens/s within the
    memory budget trains; cached with the micro-batch; on the CPU: none)."""
    ac_every_n_layers: int = 2
    """With selective activation checkpointing: checkpoint one block in this many."""
    reduce_dtype: str = "fp32"
    """Gradient reduction dtype: fp32 (default, stable) or the compute dtype."""
    grad_sync: str = "auto"
    """When gradient accumulation reduces the gradients: every_micro_batch (a reduce-scatter after each
    micro-batch's backward, overlapped with it: gradients stay sharded; with HYBRID_SHARD under FSDP2 the
    all-reduce across replicas waits for the last micro-batch) or last_micro_batch (one reduction per step;
    until then every rank holds the whole model's gradients unsharded, in fp32 with FSDP2's fp32 reduction:
    less communication for a lot of memory, for slow networks). auto: last_micro_batch with NO_SHARD (its
    gradients are whole anyway), every_micro_batch otherwise."""
    meta_init: bool = True
    """Build the model on the meta device and materialise it shard by shard (multi-rank runs)."""


@dataclass
class CheckpointConfig:
    format: str = "full"
    """full (one fsdp_cpt{step}.pth) or sharded (fsdp_sharded_cpt{step}/, one file per rank)."""
    interval: int = 0
    """Save every this many steps (0: only the final save)."""
    keep_last_n: int = 3
    """Keep this many newest complete checkpoints (0: keep all)."""
    auto_resume: bool = True
    """Continue from the newest complete checkpoint in the output directory, if any."""
    verify: bool = True
    """Before loading a checkpoint, check every file's CRC32 against the one recorded when it was saved
    (reads the checkpoint once more, spread over the ranks); `latest` falls back past a mismatch."""
    async_save: bool | str = "auto"
    """Sharded checkpoints: stage the state in host memory, then write it in the background while training
    goes on; it counts (checksums, meta.json, rename, retention) once written. auto: on for sharded
    checkpoints on GPUs; true (also on the CPU); false. Full checkpoints are always written synchronously."""
    async_writer: str = "thread"
    """With async_save: write from a thread of the training process, or from a process of its own that
    torch.distributed.checkpoint starts (no competition for the training process's Python interpreter)."""
    on_async_error: str = "stop"
    """A background write that failed (reported at the next step, naming the checkpoint): stop (exit 1,
    the previous checkpoint stays the newest) or continue training (the next save tries again). A failed
    final save always ends the run with an error."""
    allow_tokenizer_change: bool = False
    """Resume from a checkpoint trained with another tokenizer (a deliberate vocabulary swap). Off: such a
    resume is refused. On: the previous tokenizer is kept next to the checkpoints as tokenizer.<hash8>.model."""


@dataclass
class LoggingConfig:
    interval: int = 10
    """Log a line, a metrics.jsonl row and a row to every tracker every this many steps."""
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers that receive every metrics.jsonl row, the resolved config and the run name (rank 0
    only): any of tensorboard (<output_dir>/tensorboard/), wandb, mlflow; [] for metrics.jsonl alone. Each
    package is imported only when named here; a resumed run continues the same tracked run."""
    tensorboard: bool | None = None
    """Deprecated, kept for older configs: false removes tensorboard from logging.trackers, true adds it.
    Prefer logging.trackers."""
    wandb_project: str = "fsdp-lm"
    """Weights & Biases project (logging.trackers: [wandb]); the W&B run is named after run.name."""
    wandb_entity: str = ""
    """Weights & Biases entity (user or team); empty: the logged-in user's default."""
    wandb_mode: str = ""
    """online, offline (files under <output_dir>/wandb/, `wandb sync` them later) or disabled; empty: the
    WANDB_MODE environment variable, else W&B's default (online)."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking URI (a server, or sqlite:///path.db with the full mlflow package); empty: the
    MLFLOW_TRACKING_URI environment variable, else a local file store in <output_dir>/mlruns
    (`mlflow ui --backend-store-uri <output_dir>/mlruns`), which needs only mlflow-skinny."""
    mlflow_experiment: str = "fsdp-lm"
    """MLflow experiment that holds the run (created if missing); the MLflow run is named after run.name."""
    peak_tflops: float = 0.0
    """Per-GPU dense bf16 peak in TFLOP/s for MFU; 0: the GPU's row in the table of docs/observability.md
    (an unknown GPU, or the CPU, gets no MFU, and the log says so)."""
    peak_flops: float = 0.0
    """Deprecated, kept for older configs: the same peak in FLOP/s (989e12); use logging.peak_tflops (989)."""
    profile_steps: list[int] = field(default_factory=list)
    """[start, end]: record a torch.profiler trace of training steps start..end (1-based, both included) into
    <output_dir>/profile/steps<start>-<end>/rank<r>.pt.trace.json (Perfetto, chrome://tracing, TensorBoard's
    profiler plugin); [] for none."""
    profile_ranks: str = "rank0"
    """Which ranks write profiles and memory snapshots: rank0 or all."""
    memory_snapshot: bool = False
    """Record the CUDA allocator's history and dump a snapshot (<output_dir>/memory/*.pickle, for
    pytorch.org/memory_viz) on an out-of-memory error and at logging.memory_snapshot_step. GPU runs only: a
    CPU run says so in one warning and records nothing."""
    memory_snapshot_step: int = 0
    """Dump a memory snapshot after this training step (1-based); 0: only on out-of-memory."""
    memory_snapshot_max_entries: int = 100_000
    """Allocation events kept in the recorded history (the oldest are dropped first)."""

    @property
    def tracker_names(self) -> list[str]:
        """logging.trackers with the deprecated logging.tensorboard applied: the trackers this run opens."""
        names = [n for n in self.trackers if n != "tensorboard" or self.tensorboard is not False]
        if self.tensorboard and "tensorboard" not in names:
            names.insert(0, "tensorboard")
        return names

    @property
    def peak_override_flops(self) -> float:
        """The configured peak in FLOP/s (0: look the GPU up)."""
        return self.peak_tflops * 1e12 if self.peak_tflops else self.peak_flops


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir or Path("checkpoints") / self.run.name)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- loading ---------------------------------------------------------------------------------------


def _closest(name: str, options, prefix: str = "") -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean '{prefix}{match[0]}'?)" if match else ""


# How a type problem names what was expected and what was given, in the words of YAML.
_EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_GIVEN = {int: "the integer", float: "the number", bool: "the boolean", str: "the string", list: "the list",
          dict: "the mapping", type(None): "null"}


def _type_problem(where: str, value, kinds: Sequence[type]) -> str:
    """"model.dim: expected an integer, got the string '128'", with a hint where quotes are the mistake."""
    expected = " or ".join(_EXPECTED.get(t, t.__name__) for t in kinds)
    given = "null" if value is None else f"{_GIVEN.get(type(value), type(value).__name__)} {value!r}"
    text = f"{where}: expected {expected}, got {given}"
    if isinstance(value, str) and int in kinds and value.strip().lstrip("+-").isdigit():
        text += " (in quotes, a number is a string: write it without them)"
    return text


def _coerce(value, hint, where: str, problems: list[str]):
    """Check `value` against type `hint`; return it (ints accepted for floats). Appends to problems."""
    if isinstance(value, _LongInt):  # whatever the field's type: no value of a config has that many digits
        problems.append(f"{where}: an integer of {value.digits:,} digits, far out of range")
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        kinds = [t for t in options if t is not type(None)]
        if len(kinds) > 1:  # e.g. int | str: a value of one of them, as it is
            if not any(isinstance(value, t) and not (t is int and isinstance(value, bool)) for t in kinds):
                problems.append(_type_problem(where, value, kinds))
            return value
        hint = kinds[0]
        origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, str):  # a single path is accepted where a list is expected
            value = [value]
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {value!r}")
            return value
        return [_coerce(v, item, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a section of its own, e.g. data.sources[0]
        if not isinstance(value, dict):
            problems.append(f"{where}: expected a mapping, got {value!r}")
            return hint()
        return _build(hint, value, where, problems)
    if hint is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        return _coerce_float(value, where, problems)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        problems.append(_type_problem(where, value, [hint]))
    return value


def _coerce_float(value: int | float | str, where: str, problems: list[str]) -> float | str:
    """A float field's value: ints become floats; a string that reads as a number is accepted, because
    YAML reads 3e-4 as a string (YAML 1.1 needs a dot); NaN and infinities are refused."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            problems.append(_type_problem(where, value, [float]))
            return value
    else:
        number = float(value)
    if not math.isfinite(number):
        problems.append(f"{where}: must be a finite number, got {value!r}")
        return value if isinstance(value, float) else number
    return number


def _build(cls, raw: dict, where: str, problems: list[str]):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if not isinstance(key, str):  # YAML keys may be numbers, null or lists
            problems.append(f"{where.lstrip('.') or 'top level'}: key {key!r} is not a name")
            continue
        if key not in names:
            full_key, prefix = (where + "." + key).lstrip("."), (where + ".").lstrip(".")
            problems.append(f"unknown key '{full_key}'{_closest(key, names, prefix)}")
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            value = {} if value is None else value  # a section whose keys are all commented out
            if not isinstance(value, dict):
                problems.append(f"{(where + '.' + key).lstrip('.')}: expected a section (mapping), got {value!r}")
                continue
            kwargs[key] = _build(hint, value, f"{where}.{key}", problems)
        else:
            before = len(problems)
            coerced = _coerce(value, hint, f"{where}.{key}".lstrip("."), problems)
            if len(problems) == before:  # a mistyped value keeps the default, so value checks still run
                kwargs[key] = coerced
    return cls(**kwargs)


def split_known_args(parser, argv: list[str]):
    """parser.parse_known_args, the rest being `--section.key=value` overrides; anything else is a usage
    error (argparse's, exit 2). Shared by train_fsdp.py and the scripts that take the same config."""
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--") and "=" in o and "." in o.split("=", 1)[0])]
    if bad:
        parser.error(f"unrecognised argument {bad[0]!r}: overrides look like --section.key=value")
    return args, overrides


class _Refused(yaml.YAMLError):
    """Valid YAML that the loader refuses; the message says why and where."""


def _at(mark: yaml.Mark | None) -> str:
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""


def _expansion(root: yaml.Node) -> int:
    """How many more values the document holds once every alias (and merge key) is written out than it
    spells out itself; _Refused when an alias refers to a value that contains it."""
    sizes: dict[int, int] = {}  # id(node) -> values in it, aliases expanded
    ancestors: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # depth first, without recursion: nesting depth is the document's to choose
        node, finished = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        if finished:
            ancestors.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
        elif id(node) in ancestors:
            raise _Refused("an alias refers to a value that contains it")
        elif id(node) not in sizes:
            ancestors.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children)
    return sizes[id(root)] - len(sizes)


class _LongInt:
    """A YAML integer with more digits than Python converts (sys.get_int_max_str_digits), kept as its length
    so that the type check reports it under its key."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits:,} digits>"


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses what a config never holds and would otherwise fail far from its cause:
    aliases that repeat more than MAX_ALIAS_VALUES values ("billion laughs": a few hundred bytes that grow
    to gigabytes once the tree is walked), nesting deeper than MAX_NESTING (the composer recurses once per
    level, a RecursionError), and a key given twice in one mapping (the last would silently win)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        if self.depth >= MAX_NESTING:
            raise _Refused(f"nested more than {MAX_NESTING} levels deep{_at(self.peek_event().start_mark)}")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_document(self, node: yaml.Node):
        if _expansion(node) > MAX_ALIAS_VALUES:
            raise _Refused(f"its aliases repeat more than {MAX_ALIAS_VALUES:,} values (an alias bomb?); "
                           f"write the values out instead")
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict = {}  # key -> its key node; merge keys (<<) are overridden by design, so not counted
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                earlier = first.setdefault(key, key_node)
            except TypeError:  # a list or mapping as a key: SafeConstructor says so itself
                continue
            if earlier is not key_node:
                raise _Refused(f"key {key!r} is given twice{_at(key_node.start_mark)}, first at line "
                               f"{earlier.start_mark.line + 1}, column {earlier.start_mark.column + 1}; give each "
                               f"key once")
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: yaml.ScalarNode):
        try:
            value = super().construct_yaml_int(node)
        except ValueError:  # past Python's limit on the digits of a decimal integer
            return _LongInt(sum(c.isdigit() for c in node.value))
        # Hexadecimal, binary and base-60 integers have no such limit, yet could not be printed in decimal.
        digits = int(value.bit_length() * math.log10(2)) + 1
        return _LongInt(digits) if 0 < sys.get_int_max_str_digits() < digits else value


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """One line for a YAML error: what went wrong and, when known, where."""
    problem = getattr(err, "problem", None)
    if not problem:
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{problem}{_at(getattr(err, 'problem_mark', None))}"


def parse_override(arg: str) -> tuple[list[str], object]:
    """'--train.lr=1e-3' -> (['train', 'lr'], 0.001). Values are parsed as YAML scalars."""
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body:
        raise ConfigError([f"override '{arg}' must look like --section.key=value"])
    key, value = body.split("=", 1)
    try:
        return key.split("."), yaml.load(value, Loader=_BoundedLoader) if value != "" else ""
    except yaml.YAMLError as err:  # the value itself may be long (a list of files): name the key
        if isinstance(err, _Refused):
            raise ConfigError([f"override --{key}: {err}"]) from None
        raise ConfigError([f"override --{key}: not valid YAML: {_yaml_problem(err)}"]) from None


def _read_yaml(path: Path) -> dict:
    if path.is_dir():
        raise ConfigError([f"{path} is a directory; give a config file, e.g. config/train_tiny_fsdp.yaml"])
    if not path.is_file():
        raise ConfigError([f"config file not found: {path}"])
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError([f"{path}: {path.stat().st_size:,} bytes is not a config file (at most "
                               f"{MAX_CONFIG_BYTES:,}); give the YAML file, e.g. config/train_tiny_fsdp.yaml"])
        text = path.read_bytes()  # bytes: YAML finds the encoding, and undecodable text is a YAMLError
    except OSError as err:
        raise ConfigError([f"{path}: cannot read: {err.strerror or err}"]) from None
    try:
        raw = yaml.load(text, Loader=_BoundedLoader) or {}
    except _Refused as err:
        raise ConfigError([f"{path}: {err}"]) from None
    except yaml.YAMLError as err:
        raise ConfigError([f"{path}: not valid YAML: {_yaml_problem(err)}"]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: top level must be a mapping of sections"])
    return raw


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Read YAML, apply overrides, validate everything; raise ConfigError listing every problem."""
    raw = {} if path is None else _read_yaml(Path(path))
    problems: list[str] = []
    for arg in overrides:
        try:
            keys, value = parse_override(arg)
        except ConfigError as err:
            problems += err.problems
            continue
        node = raw
        for k in keys[:-1]:
            if node.get(k) is None:
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                problems.append(f"override '{arg}': '{k}' is not a section")
                break
        else:
            node[keys[-1]] = value
    cfg = _build(Config, raw, "", problems)
    problems += validate(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def _choice(problems: list[str], where: str, value: str, options) -> None:
    if value not in options:
        problems.append(f"{where}='{value}' is not one of {', '.join(options)}{_closest(str(value), options)}")


def validate(cfg: Config) -> list[str]:
    """Value checks that do not depend on the world size (see check_batch_split for that)."""
    p = _model_problems(cfg) + _data_problems(cfg) + _train_problems(cfg) + _run_problems(cfg.run)
    p += _fsdp_problems(cfg.fsdp) + _checkpoint_problems(cfg.checkpoint)
    p += _logging_problems(cfg.logging, max_steps=cfg.train.max_steps)
    return p


def _logging_problems(lg: LoggingConfig, *, max_steps: int) -> list[str]:
    p: list[str] = []
    if lg.interval <= 0:
        p.append(f"logging.interval must be positive, got {lg.interval}")
    for name in lg.trackers:
        _choice(p, "logging.trackers", name, TRACKERS)
    if len(set(lg.trackers)) < len(lg.trackers):
        p.append(f"logging.trackers names a tracker twice: {lg.trackers}")
    _choice(p, "logging.wandb_mode", lg.wandb_mode, ("", "online", "offline", "disabled"))
    for name in ("peak_tflops", "peak_flops"):
        if getattr(lg, name) < 0:
            p.append(f"logging.{name} must not be negative, got {getattr(lg, name)}")
    if lg.peak_tflops and lg.peak_flops:
        p.append("logging.peak_flops (deprecated, FLOP/s) and logging.peak_tflops are both set: keep only "
                 f"logging.peak_tflops={lg.peak_flops / 1e12:g}")
    elif 0 < lg.peak_flops < 1e9:
        p.append(f"logging.peak_flops={lg.peak_flops:g} is in FLOP/s (989e12 for an H100); for TFLOP/s use "
                 f"logging.peak_tflops={lg.peak_flops:g}")
    if lg.profile_steps:
        if len(lg.profile_steps) != 2 or not 1 <= lg.profile_steps[0] <= lg.profile_steps[1]:
            p.append(f"logging.profile_steps must be [start, end] with 1 <= start <= end, got {lg.profile_steps}")
        elif lg.profile_steps[1] > max_steps:
            p.append(f"logging.profile_steps={lg.profile_steps} ends after train.max_steps={max_steps}")
    _choice(p, "logging.profile_ranks", lg.profile_ranks, ("rank0", "all"))
    if lg.memory_snapshot_step < 0:
        p.append(f"logging.memory_snapshot_step must not be negative, got {lg.memory_snapshot_step}")
    elif lg.memory_snapshot_step and not lg.memory_snapshot:
        p.append("logging.memory_snapshot_step needs logging.memory_snapshot: true (the history is recorded "
                 "from the start of training)")
    elif lg.memory_snapshot_step > max_steps:
        p.append(f"logging.memory_snapshot_step={lg.memory_snapshot_step} is after train.max_steps={max_steps}")
    if lg.memory_snapshot_max_entries <= 0:
        p.append(f"logging.memory_snapshot_max_entries must be positive, got {lg.memory_snapshot_max_entries}")
    return p


def _model_problems(cfg: Config) -> list[str]:
    p: list[str] = []
    m = cfg.model
    if m.vocab_size and m.vocab_size < 0:
        p.append(f"model.vocab_size must be 0 (take it from the tokenizer) or positive, got {m.vocab_size}")
    _choice(p, "model.type", m.type, ("llama", "hf"))
    _choice(p, "data.tokenizer", cfg.data.tokenizer, ("sentencepiece", "hf"))
    if m.type == "llama":
        dims = {f.name: getattr(m, f.name) for f in dataclasses.fields(ModelConfig)}
        p += ModelConfig(**dims | {"vocab_size": m.vocab_size or 1}).problems()
        if cfg.data.tokenizer == "hf" and not cfg.data.hf_tokenizer:
            p.append("data.tokenizer=hf with model.type=llama needs data.hf_tokenizer (a folder with a Hugging Face "
                     "tokenizer)")
    elif m.type == "hf":
        p += _hf_model_problems(cfg)
    for where, path in (("model.init_from", m.init_from), ("data.hf_tokenizer", cfg.data.hf_tokenizer)):
        if path and not Path(path).exists():
            p.append(f"{where}: not found: {path}")
    return p


def _hf_model_problems(cfg: Config) -> list[str]:
    p: list[str] = []
    m = cfg.model
    if bool(m.hf_path) == bool(m.hf_config):
        p.append("model.type=hf needs exactly one of model.hf_path (pretrained folder) or model.hf_config "
                 "(config.json)")
    for name in ("hf_path", "hf_config"):
        if getattr(m, name) and not Path(getattr(m, name)).exists():
            p.append(f"model.{name}: not found: {getattr(m, name)}")
    if cfg.data.tokenizer == "hf" and not m.hf_path and not cfg.data.hf_tokenizer:
        p.append("data.tokenizer=hf needs data.hf_tokenizer or model.hf_path (a folder with the tokenizer files)")
    return p


def _data_problems(cfg: Config) -> list[str]:
    p: list[str] = []
    d = cfg.data
    if d.seq_len <= 0:
        p.append(f"data.seq_len must be positive, got {d.seq_len}")
    elif cfg.model.type == "llama" and d.seq_len > cfg.model.max_seq_len:
        p.append(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if not 0 < d.val_fraction < 1:
        p.append(f"data.val_fraction must be between 0 and 1, got {d.val_fraction}")
    if d.vocab_size < 16 and not d.tokenizer_model:
        p.append(f"data.vocab_size must be at least 16, got {d.vocab_size}")
    _choice(p, "data.on_bad_record", d.on_bad_record, ("error", "skip"))
    for name in ("max_corpus_mb", "num_workers", "max_in_job_mb"):
        if getattr(d, name) < 0:
            p.append(f"data.{name} must not be negative, got {getattr(d, name)}")
    for name in ("shard_tokens", "prepare_wait_s"):
        if getattr(d, name) <= 0:
            p.append(f"data.{name} must be positive, got {getattr(d, name)}")
    if not d.max_document_mb * 2**20 >= 1:  # a smaller bound leaves no byte of a document to read
        p.append(f"data.max_document_mb must be at least one byte ({1 / 2**20:.3g} MB), got {d.max_document_mb}")
    if not d.text_field:
        p.append("data.text_field must name the field or column holding the text")
    if cfg.model.type == "hf" and d.document_masking != cfg.model.reset_positions:
        # transformers detects packed documents only where position_ids restart, and masks at every restart.
        p.append(f"model.type=hf: data.document_masking={d.document_masking} needs model.reset_positions="
                 f"{d.document_masking} (transformers masks documents exactly where their positions restart)")
    p += _format_problems(d)
    if d.sources:
        if d.files or d.dataset_dir:
            p.append("data.sources replaces data.files and data.dataset_dir: leave those empty (--data.files=[])")
        from data.mixture import source_problems  # reads the folders' meta.json; imported only when needed

        p += source_problems([(s.path, s.weight) for s in d.sources], wanted_format=d.format)
    return p


def _format_problems(d: DataConfig) -> list[str]:
    p: list[str] = []
    _choice(p, "data.format", d.format, ("text", "chat"))
    _choice(p, "data.chat_template", d.chat_template, ("auto", "plain"))
    for name in ("messages_field", "prompt_field", "response_field"):
        if not getattr(d, name):
            p.append(f"data.{name} must name a field of the records")
    if d.format == "chat" and not d.files and not d.dataset_dir and not d.sources:
        p.append("data.format=chat needs data.files (.jsonl conversations) or a prepared data.dataset_dir")
    meta_path = Path(d.dataset_dir) / "meta.json"
    if d.dataset_dir and meta_path.is_file():
        from data.mixture import format_problem
        from data.store import read_record

        if (problem := format_problem(d.dataset_dir, read_record(meta_path), d.format)) is not None:
            p.append(f"data.format={d.format}: {problem}")
    return p


def _batch_problems(t: TrainConfig) -> list[str]:
    p: list[str] = []
    for name in ("max_steps", "global_batch_size"):
        if getattr(t, name) <= 0:
            p.append(f"train.{name} must be positive, got {getattr(t, name)}")
    if isinstance(t.micro_batch_size, str):
        if t.micro_batch_size != "auto":
            p.append(f"train.micro_batch_size must be a positive integer or auto, got '{t.micro_batch_size}'")
    elif t.micro_batch_size <= 0:
        p.append(f"train.micro_batch_size must be positive, got {t.micro_batch_size}")
    elif t.global_batch_size % t.micro_batch_size:
        p.append(f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                 f"train.micro_batch_size={t.micro_batch_size}")
    if not 0 <= t.auto_micro_batch_margin < 1:
        p.append(f"train.auto_micro_batch_margin must be in [0, 1), got {t.auto_micro_batch_margin}")
    if t.auto_micro_batch_cpu <= 0:
        p.append(f"train.auto_micro_batch_cpu must be positive, got {t.auto_micro_batch_cpu}")
    if t.eval_batches <= 0:
        p.append(f"train.eval_batches must be positive, got {t.eval_batches}")
    return p


def _train_problems(cfg: Config) -> list[str]:
    t = cfg.train
    p = _batch_problems(t)
    for name in ("warmup_steps", "eval_interval", "grad_clip", "weight_decay"):
        if getattr(t, name) < 0:
            p.append(f"train.{name} must not be negative, got {getattr(t, name)}")
    if t.lr <= 0:
        p.append(f"train.lr must be positive, got {t.lr}")
    for name in ("beta1", "beta2"):  # AdamW's decay rates: 1 never forgets, past it the moments diverge
        if not 0 <= getattr(t, name) < 1:
            p.append(f"train.{name} must be in [0, 1), got {getattr(t, name)}")
    if t.loss_chunk_tokens < 0:
        p.append(f"train.loss_chunk_tokens must be 0 (off) or positive, got {t.loss_chunk_tokens}")
    p += _schedule_problems(t)
    _choice(p, "train.precision", t.precision, PRECISIONS)
    _choice(p, "train.float8", t.float8, FLOAT8)
    if t.float8 != "none" and cfg.fsdp.version == 1:
        p.append(f"train.float8={t.float8} needs fsdp.version: 2 (torchao's FP8 training, FP8 all-gather of the "
                 f"sharded weights included, is built for FSDP2's fully_shard)")
    if t.compile_tuning and not t.compile:
        p.append("train.compile_tuning=true tunes the compiled kernels and needs train.compile: true")
    if t.max_bad_steps < 0:
        p.append(f"train.max_bad_steps must not be negative, got {t.max_bad_steps}")
    return p + _lora_problems(cfg) + _eval_tasks_problems(t)


def lora_targets(names: Sequence[str]) -> list[str]:
    """train.lora.targets with the groups written out, in LORA_TARGETS order."""
    chosen = {t for name in names for t in LORA_GROUPS.get(name, (name,))}
    return [t for t in LORA_TARGETS if t in chosen]


def _lora_problems(cfg: Config) -> list[str]:
    lora, p = cfg.train.lora, []
    if lora.rank < 0:
        p.append(f"train.lora.rank must be 0 (off) or positive, got {lora.rank}")
    if lora.rank <= 0:
        return p
    if lora.alpha <= 0:
        p.append(f"train.lora.alpha must be positive, got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        p.append(f"train.lora.dropout must be in [0, 1), got {lora.dropout}")
    options = (*LORA_TARGETS, *LORA_GROUPS)
    for name in lora.targets:
        _choice(p, "train.lora.targets", name, options)
    if not lora.targets:
        p.append("train.lora.targets is empty: name the projections to adapt, e.g. [all] or [q, v]")
    if cfg.train.float8 != "none":
        p.append(f"train.float8={cfg.train.float8} cannot be combined with train.lora (the FP8 converter replaces the "
                 f"linear layers that carry the adapters): set train.float8: none for LoRA fine-tuning")
    if cfg.fsdp.version == 1 and not cfg.fsdp.use_orig_params:
        p.append("train.lora needs fsdp.use_orig_params: true with fsdp.version 1 (frozen and trainable "
                 "parameters are told apart by their original names)")
    return p


def wsd_decay_steps(max_steps: int, decay_fraction: float) -> int:
    """Steps in WSD's final decay: decay_fraction of max_steps, rounded, at least one."""
    return max(1, round(decay_fraction * max_steps))


def _schedule_problems(t: TrainConfig) -> list[str]:
    p: list[str] = []
    _choice(p, "train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    _choice(p, "train.decay_shape", t.decay_shape, DECAY_SHAPES)
    if t.min_lr is not None and t.min_lr_ratio is not None:
        p.append(f"train.min_lr={t.min_lr} and train.min_lr_ratio={t.min_lr_ratio} are both set: give one (min_lr is "
                 "the floor itself, min_lr_ratio the floor as a fraction of train.lr)")
    elif t.min_lr is not None and not 0 <= t.min_lr <= t.lr:
        p.append(f"train.min_lr must be in [0, train.lr={t.lr}], got {t.min_lr}")
    elif t.min_lr_ratio is not None and not 0 <= t.min_lr_ratio <= 1:
        p.append(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    if t.lr_schedule != "wsd" and t.warmup_steps > t.max_steps > 0:  # wsd: below, its decay must fit too
        p.append(f"train.warmup_steps={t.warmup_steps} exceeds train.max_steps={t.max_steps}: the run would end "
                 f"inside its warmup, before reaching train.lr; lower train.warmup_steps to at most {t.max_steps}")
    if not 0 < t.decay_fraction <= 1:
        p.append(f"train.decay_fraction must be in (0, 1], got {t.decay_fraction}")
    elif t.lr_schedule == "wsd" and t.max_steps > 0 and t.warmup_steps >= 0:
        decay = wsd_decay_steps(t.max_steps, t.decay_fraction)
        if t.warmup_steps + decay > t.max_steps:
            p.append(f"train.lr_schedule=wsd: train.warmup_steps={t.warmup_steps} plus the decay's "
                     f"{decay} steps (train.decay_fraction={t.decay_fraction} of train.max_steps={t.max_steps}) "
                     f"exceed train.max_steps; shorten the warmup or the decay")
    return p


def _eval_tasks_problems(t: TrainConfig) -> list[str]:
    """The shape of train.eval_tasks*; whether lm-eval knows the tasks is checked at launch (train_fsdp.py)."""
    p: list[str] = []
    if t.eval_tasks_limit < 0:
        p.append(f"train.eval_tasks_limit must be 0 (all documents) or positive, got {t.eval_tasks_limit}")
    if any(not name.strip() for name in t.eval_tasks):
        p.append("train.eval_tasks: a task name is empty")
    if t.eval_tasks and t.eval_interval == 0:
        p.append("train.eval_tasks run at every train.eval_interval, which is 0 (off); set train.eval_interval")
    p += [f"train.eval_tasks_path: not found: {path}" for path in t.eval_tasks_path if not Path(path).exists()]
    return p


def _run_name_problem(name: str) -> str | None:
    """run.name names a folder of checkpoints/: one path component, so that the output stays inside it."""
    separators = {"/", "\\", os.sep, os.altsep or "/"}
    too_long = len(name.encode("utf-8", "surrogatepass")) > 255  # a file name's limit on Linux filesystems
    if name in ("", ".", "..") or too_long or any(c in separators or not c.isprintable() for c in name):
        return (f"run.name={name!r} must be a plain folder name (1 to 255 bytes, not '.' or '..', no '/', '\\' or "
                f"control characters): the output goes to checkpoints/<run.name>; set run.output_dir for another place")
    return None


def _run_problems(r: RunConfig) -> list[str]:
    p: list[str] = []
    if (problem := _run_name_problem(r.name)) is not None:
        p.append(problem)
    _choice(p, "run.device", r.device, ("auto", "cuda", "cpu"))
    for name in r.stop_signals:
        if name not in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"):
            p.append(f"run.stop_signals: '{name}' is not one of SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP")
    if not 0 <= r.seed <= MAX_SEED:
        p.append(f"run.seed must be in [0, 2**63 - 1], got {r.seed}")
    for name in ("timeout_s", "preemption_grace_s"):
        if not 0 < getattr(r, name) <= MAX_SECONDS:
            p.append(f"run.{name} must be in (0, 10**9] seconds, got {getattr(r, name)}")
    return p


def _fsdp_problems(f: FSDPConfig) -> list[str]:
    p: list[str] = []
    if f.version not in (1, 2):
        p.append(f"fsdp.version must be 1 or 2, got {f.version}")
    _choice(p, "fsdp.sharding_strategy", f.sharding_strategy, SHARDING_STRATEGIES)
    _choice(p, "fsdp.backward_prefetch", f.backward_prefetch, BACKWARD_PREFETCH)
    _choice(p, "fsdp.activation_checkpointing", f.activation_checkpointing, ACTIVATION_CHECKPOINTING)
    _choice(p, "fsdp.reduce_dtype", f.reduce_dtype, ("fp32", "compute"))
    _choice(p, "fsdp.grad_sync", f.grad_sync, ("auto", "every_micro_batch", "last_micro_batch"))
    if f.ac_every_n_layers <= 0:
        p.append(f"fsdp.ac_every_n_layers must be positive, got {f.ac_every_n_layers}")
    if f.hybrid_shard_group_size < 0:
        p.append(f"fsdp.hybrid_shard_group_size must not be negative, got {f.hybrid_shard_group_size}")
    return p


def _checkpoint_problems(c: CheckpointConfig) -> list[str]:
    p: list[str] = []
    _choice(p, "checkpoint.format", c.format, ("full", "sharded"))
    for name in ("interval", "keep_last_n"):
        if getattr(c, name) < 0:
            p.append(f"checkpoint.{name} must not be negative, got {getattr(c, name)}")
    if isinstance(c.async_save, str) and c.async_save != "auto":
        p.append(f"checkpoint.async_save must be auto, true or false, got '{c.async_save}'")
    elif c.async_save is True and c.format == "full":
        p.append("checkpoint.async_save=true needs checkpoint.format=sharded (full checkpoints are written "
                 "synchronously)")
    _choice(p, "checkpoint.async_writer", c.async_writer, ("thread", "process"))
    _choice(p, "checkpoint.on_async_error", c.on_async_error, ("stop", "continue"))
    return p


def check_batch_split(cfg: Config, world_size: int, micro_batch: int | None = None) -> int | None:
    """Gradient accumulation steps for this world size and micro-batch (train.micro_batch_size unless given);
    ConfigError when the split is not whole. With micro_batch_size=auto and no micro_batch: only checks that
    the global batch splits over the ranks, and returns None (the micro-batch is measured later)."""
    t = cfg.train
    if micro_batch is None and t.micro_batch_size == "auto":
        if t.global_batch_size % world_size:
            raise ConfigError([
                f"train.global_batch_size={t.global_batch_size} is not divisible by the world size {world_size} "
                f"(train.micro_batch_size=auto splits each rank's share of it); pick a multiple of {world_size}"
            ])
        return None
    micro = micro_batch or t.micro_batch_size
    assert isinstance(micro, int), "micro_batch_size=auto returned above"
    per_step = micro * world_size
    if t.global_batch_size % per_step:
        raise ConfigError([
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size * world size "
            f"= {micro} * {world_size} = {per_step}; pick a global batch that is a multiple of {per_step}"
        ])
    return t.global_batch_size // per_step


def launch_problems(cfg: Config, *, world_size: int, local_world_size: int, num_gpus: int) -> list[str]:
    """Checks of the config against the launch (world size, GPUs, the output directory): every problem
    that can be found before the process group starts."""
    p: list[str] = []
    try:
        check_batch_split(cfg, world_size)
    except ConfigError as err:
        p += err.problems
    f = cfg.fsdp
    if f.sharding_strategy == "HYBRID_SHARD":
        group = f.hybrid_shard_group_size or local_world_size
        if world_size % group:
            where = f"fsdp.hybrid_shard_group_size={group}" if f.hybrid_shard_group_size else \
                f"fsdp.hybrid_shard_group_size=0 (the processes per node, {group})"
            p.append(f"{where} does not divide the world size {world_size}; pick a divisor of {world_size}")
    if cfg.run.device == "cuda" and num_gpus == 0:
        p.append("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
    elif cfg.run.device != "cpu" and 0 < num_gpus < local_world_size:
        p.append(f"{local_world_size} processes on this node but only {num_gpus} CUDA devices are visible; "
                 f"start at most {num_gpus} (--nproc_per_node), or use run.device=cpu")
    p += output_dir_problems(cfg.output_dir)
    return p


def output_dir_problems(out: Path) -> list[str]:
    """run.output_dir is a directory (or can be made one) that this user may write into."""
    existing = out
    while not os.path.exists(existing) and existing != existing.parent:  # the nearest part that exists
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == out else f"cannot be created: {existing} is a file"
        return [f"run.output_dir={out} {what}, not a directory"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"run.output_dir={out} is not writable ({existing}: permission denied or a read-only filesystem)"]
    return []


def summarize_config(cfg: Config) -> list[str]:
    """A few lines for the console; the whole resolved config goes to <output_dir>/config.yaml."""
    d, t, f, c = cfg.data, cfg.train, cfg.fsdp, cfg.checkpoint
    corpus = d.dataset_dir or ", ".join(d.files) or ", ".join(s.path for s in d.sources)
    return [
        f"run {cfg.run.name}: output {cfg.output_dir} (the resolved config: config.yaml there), seed {cfg.run.seed}",
        f"data: {corpus or 'the default corpus'}, seq {d.seq_len}, tokenizer {d.tokenizer}, format {d.format}",
        f"train: {t.max_steps} steps, global batch {t.global_batch_size}, micro-batch {t.micro_batch_size}, "
        f"lr {t.lr:g} ({t.lr_schedule}, warmup {t.warmup_steps}), precision {t.precision}, float8 {t.float8}, "
        f"compile {t.compile}",
        f"fsdp: version {f.version}, {f.sharding_strategy}, activation checkpointing {f.activation_checkpointing}; "
        f"checkpoint: {c.format} every {c.interval} steps, keep {c.keep_last_n}",
    ]


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config, renamed into place: a symbolic link at `path` is replaced, never written through."""
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.unlink(missing_ok=True)
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, path)
