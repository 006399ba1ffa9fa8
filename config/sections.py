"""The sections of the config tree: one dataclass per YAML section, a docstring under each field
(docs/configuration.md is generated from them by tests/tools/config_reference.py); the data section, which data/
shares, is in data/settings.py. A string field with a fixed set of values is typed Literal: the loader checks the
value against those choices."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from data.settings import DEFAULT_SEED, DataConfig
from model import ModelConfig
from safe_io.urls import without_credentials

ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
BackwardPrefetch = Literal["BACKWARD_PRE", "BACKWARD_POST", "NONE"]
Precision = Literal["auto", "bf16", "fp16", "fp32"]
ActivationCheckpointing = Literal["none", "full", "selective", "selective_op_wide", "selective_op", "selective_op_lean",
                                  "auto"]
Float8 = Literal["none", "tensorwise", "rowwise"]
LRScheduleKind = Literal["cosine", "wsd", "constant"]
DecayShape = Literal["linear", "1-sqrt"]
Optimizer = Literal["adamw", "muon"]
# train.lora.targets: one name per projection of a Llama-style block, and the groups of them
# (fsdp_utils/parallel/lora.py writes the groups out).
LoRATarget = Literal["q", "k", "v", "o", "gate", "up", "down", "attention", "mlp", "all"]
Tracker = Literal["tensorboard", "wandb", "mlflow"]

# Fields that no longer exist, each with what replaces it: a config that sets one is refused with that line.
REMOVED_FIELDS = {
    "train.eval_batches": "train.eval_samples, the validation sequences per evaluation (the old value times "
                          "train.micro_batch_size gives the same data)",
    "logging.tensorboard": "logging.trackers, the list of trackers to open (tensorboard in it, or [] for none)",
    "logging.peak_flops": "logging.peak_tflops, the same peak in TFLOP/s (989 for 989e12 FLOP/s)",
}


@dataclass
class RunConfig:
    name: str = "run"
    """Run name; the default output directory is checkpoints/<name>, so one folder name (no '/', not '..')."""
    output_dir: str = ""
    """Where config.yaml, metrics.jsonl, tensorboard/ and checkpoints go; empty means checkpoints/<name>."""
    seed: int = DEFAULT_SEED
    """Seed for the initial weights and the data order (the same on every rank); 0 to 2**63 - 1."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
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

    type: Literal["llama", "hf"] = "llama"
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
class LoRAConfig:
    """train.lora: low-rank adapters on the blocks' linear layers, the base model frozen (docs/training.md)."""

    rank: int = 0
    """Rank r of each adapter (0: LoRA off, every weight trains)."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on an adapter's input (training only), in [0, 1)."""
    targets: list[LoRATarget] = field(default_factory=lambda: ["all"])
    """Which projections get adapters: q, k, v, o, gate, up, down, or the groups attention (q, k, v, o), mlp
    (gate, up, down) and all. Our model's fused wqkv and w13 weights get one adapter per chosen slice; a
    Hugging Face model's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj and down_proj layers one each."""


# train.max_steps when neither it nor train.epochs is given.
DEFAULT_MAX_STEPS = 1000


@dataclass
class TrainConfig:
    max_steps: int | None = None
    """Optimizer steps to run. Give this or train.epochs, not both (--train.max_steps=null drops a config file's);
    neither given: 1000."""
    epochs: float | None = None
    """Passes over the training data instead of train.max_steps, fractions allowed: the run takes ceil(epochs x the
    training split's samples (windows of data.seq_len tokens) / global_batch_size) steps, counted once the data is
    prepared and logged at the start. Its checkpoints keep that count: a resume, at any world size, runs to the
    same step (docs/training.md)."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all ranks; gradient accumulation is derived from it."""
    micro_batch_size: int | str = 8
    """Sequences per forward pass on each rank, or auto: the largest divisor of the per-rank batch
    (global_batch_size / world size) that fits in GPU memory, measured by a few trial steps before
    training and cached in <output_dir>/microbatch_cache.json (the training is the same: same global batch)."""
    auto_micro_batch_margin: float = 0.05
    """micro_batch_size=auto: share of the GPU's memory left free (fragmentation, evaluation, the unforeseen); every
    size chosen has had its peak measured by a trial step, so this is not a hedge on a prediction."""
    auto_micro_batch_cpu: int = 8
    """micro_batch_size=auto on the CPU (no GPU memory to measure): the largest divisor of the per-rank batch up to
    this."""
    oom_retry_half: bool = False
    """On a CUDA out-of-memory error in a step or an evaluation (every rank alike), redo it with half the
    micro-batch and twice the accumulation (the same samples), and keep that size; off: stop with the figures."""
    lr: float = 3e-4
    """Peak learning rate, reached after warmup."""
    lr_schedule: LRScheduleKind = "cosine"
    """After warmup: cosine (down to the floor at max_steps), wsd (warmup-stable-decay: lr until the final
    decay_fraction of max_steps, then down to the floor; a resume with a larger max_steps keeps the stable phase
    going) or constant (lr to the end). A pure function of the step: a resume continues it exactly
    (docs/training.md)."""
    decay_fraction: float = 0.2
    """lr_schedule=wsd: the final decay's share of max_steps, in (0, 1]; the decay starts at step
    max_steps - round(decay_fraction * max_steps) and its last step runs at the floor."""
    decay_shape: DecayShape = "linear"
    """lr_schedule=wsd: the final decay's shape, linear or 1-sqrt (lr falls with 1 - sqrt(progress): fast first,
    then slowly)."""
    min_lr: float | None = None
    """The floor that cosine and wsd decay to, absolute (at most lr). Give this or min_lr_ratio, not both."""
    min_lr_ratio: float | None = None
    """The floor as a fraction of lr, in [0, 1]; neither this nor min_lr given: 0.1."""
    warmup_steps: int = 100
    """Linear warmup steps (every schedule). Longer than max_steps is a warning: the run ends inside its warmup (a
    smoke run of a preset); wsd needs room for its decay after it."""
    optimizer: Optimizer = "adamw"
    """adamw, or muon: Muon (momentum orthogonalized by Newton-Schulz iterations) on the weight matrices of the
    blocks' attention and MLP projections, AdamW on everything else (embedding, output projection, norms, biases), in
    one optimizer. Muon's learning rate is scaled per matrix to AdamW's update size, so train.lr and its schedule
    mean the same for both. muon needs fsdp.version 2 and no train.lora (docs/training.md). A run resumes only with
    the optimizer it was saved with."""
    muon_momentum: float = 0.95
    """train.optimizer=muon: Muon's momentum (Nesterov), in [0, 1)."""
    muon_ns_steps: int = 5
    """train.optimizer=muon: Newton-Schulz iterations that orthogonalize each matrix's update."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not norms or biases); with train.optimizer=muon the same
    value for Muon's matrices and AdamW's."""
    beta1: float = 0.9
    """AdamW first-moment decay, in [0, 1)."""
    beta2: float = 0.95
    """AdamW second-moment decay, in [0, 1)."""
    max_bad_steps: int = 0
    """Non-finite loss or gradient norm: skip up to this many such steps, then stop (0: stop at the first)."""
    skip_spikes: bool = True
    """Skip the update of a step whose loss or gradient norm is more than spike_sigmas standard deviations above
    its mean over the last spike_window steps (from the 20th value on): the gradients are dropped, the data and the
    schedule move on. Logged as a warning and counted in metrics.jsonl (skipped, skipped_steps); its window is
    saved in checkpoints. It adds no host sync to the step."""
    spike_sigmas: float = 6.0
    """train.skip_spikes: how many standard deviations above the window's mean make a spike."""
    spike_window: int = 128
    """train.skip_spikes: how many recent steps the mean and standard deviation are taken over (at least 2)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all shards) to this; 0 disables."""
    eval_interval: int = 100
    """Compute the validation loss every this many steps (and at the end); 0 disables."""
    eval_samples: int = 64
    """Validation sequences per evaluation, in total (split over the ranks in micro-batches): the loss is their
    summed loss over their trained targets, the same number at any world size and micro-batch."""
    eval_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks (names, or task .yaml files) run with the validation at every eval_interval, on
    all ranks with the model as it trains (sharded), each metric logged next to val_loss as eval/<task>/<metric>;
    needs the lm-eval package (docs/evaluation.md). Empty: none."""
    eval_tasks_path: list[str] = field(default_factory=list)
    """Folders of your own lm-eval task .yaml files (lm-eval's include_path), searched before its built-in tasks."""
    eval_tasks_limit: int = 0
    """Documents per task in train.eval_tasks (the first ones; 0: all)."""
    precision: Precision = "auto"
    """auto (bf16 where supported, else fp16 on GPU; fp32 on CPU), bf16, fp16 (GPUs only: its loss scaling runs
    on GPUs) or fp32."""
    compile: bool = False
    """torch.compile each DecoderBlock."""
    compile_tuning: bool = False
    """With train.compile: inductor's coordinate-descent tuning of the compiled kernels' launch configurations
    (block sizes, warps), timed on this GPU at the first compile and cached on the machine. For long runs: somewhat
    faster kernels for a longer compile at every start, longer again where the auto search compiles its trials
    (docs/benchmarks.md). The choice is timed, as inductor's default choice among its reduction kernels already is:
    a resume on the same machine (its cache) continues bit for bit, one elsewhere within rounding.
    benchmarks/benchmark.py compiles its reference the same way."""
    float8: Float8 = "none"
    """FP8 matmuls in the blocks' linear layers through torchao (an optional package: the torchao release
    built for the installed torch): none, tensorwise (one scale per tensor; FP8 all-gather of the weights)
    or rowwise (one scale per row). Needs fsdp.version 2 and a GPU of compute capability 8.9 or later (Ada, Hopper).
    Weights, optimizer state and checkpoints stay in full precision."""
    float8_output: bool = False
    """The output projection and its loss in FP8 while training (with or without train.float8, no torchao needed):
    the final norm's output and the output weight in e4m3 with one scale each, the logits' gradient in e5m2,
    the chunked loss's three matmuls through torch._scaled_mm (model/float8_projection.py). Evaluation and
    generation compute the logits in the compute precision. Needs model.type llama, model.dim, data.seq_len,
    train.loss_chunk_tokens and the vocabulary in multiples of 16, and on GPUs compute capability 8.9 or later."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA fine-tuning: {rank, alpha, dropout, targets}; rank 0 (the default) trains every weight."""
    loss_chunk_tokens: int = 0
    """Compute output logits, loss and their gradients this many tokens at a time (0: all at once).
    The (tokens x vocab) fp32 logits never exist at once: their memory saved at the same speed
    (docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.max_steps is None and self.epochs is None:
            self.max_steps = DEFAULT_MAX_STEPS

    @property
    def resolved_max_steps(self) -> int:
        """The run's optimizer steps: train.max_steps, into which train.epochs is counted once the data is prepared
        (fsdp_utils/train/resume.py run_length); the training reads it here."""
        if self.max_steps is None:
            raise AssertionError("train.epochs is counted in steps once the data is prepared, before it is read")
        return self.max_steps

    @property
    def resolved_min_lr_ratio(self) -> float:
        """The schedule's floor as a fraction of lr: from min_lr, else min_lr_ratio, else 0.1."""
        if self.min_lr is not None:
            return self.min_lr / self.lr
        return 0.1 if self.min_lr_ratio is None else self.min_lr_ratio

    @property
    def wsd_decay_steps(self) -> int:
        """lr_schedule=wsd: the steps of the final decay, decay_fraction of max_steps rounded, at least one."""
        return max(1, round(self.decay_fraction * self.resolved_max_steps))


@dataclass
class FSDPConfig:
    version: int = 1
    """1: FullyShardedDataParallel (default); 2: fully_shard."""
    sharding_strategy: ShardingStrategy = "FULL_SHARD"
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD."""
    hybrid_shard_group_size: int = 0
    """HYBRID_SHARD: ranks per shard group (0: GPUs per node, LOCAL_WORLD_SIZE), a divisor of the world size;
    groups of 1 rank run as NO_SHARD over the whole world, one group of every rank as FULL_SHARD."""
    backward_prefetch: BackwardPrefetch = "BACKWARD_PRE"
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
    activation_checkpointing: ActivationCheckpointing = "none"
    """none; full (every DecoderBlock keeps only its input); selective (full, on every
    ac_every_n_layers-th block); selective_op_wide (every block keeps its matmul and attention outputs and
    recomputes the elementwise ops); selective_op (the same, but about half the matmul outputs' bytes are
    recomputed too: the k, output and up projections');
    selective_op_lean (the output, gate and up projections' outputs recomputed); auto (on GPUs: trial steps
    measure none, selective_op, selective_op_lean and full with the micro-batch search (for a Hugging Face
    model whose projections it cannot name: none, selective_op_wide, selective and full), and the
    pair of policy and micro-batch with the most tokens/s within the memory budget trains; cached with the
    micro-batch; on the CPU: none)."""
    ac_every_n_layers: int = 2
    """With selective activation checkpointing: checkpoint one block in this many."""
    reduce_dtype: Literal["fp32", "compute"] = "fp32"
    """Gradient reduction dtype: fp32 (default, stable) or the compute dtype."""
    grad_sync: Literal["auto", "every_micro_batch", "last_micro_batch"] = "auto"
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
    format: Literal["full", "sharded"] = "full"
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
    async_writer: Literal["thread", "process"] = "thread"
    """With async_save: write from a thread of the training process, or from a process of its own that
    torch.distributed.checkpoint starts (no competition for the training process's Python interpreter)."""
    on_async_error: Literal["stop", "continue"] = "stop"
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
    trackers: list[Tracker] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers that receive every metrics.jsonl row, the resolved config and the run name (rank 0
    only): any of tensorboard (<output_dir>/tensorboard/), wandb, mlflow; [] for metrics.jsonl alone. Each
    package is imported only when named here; a resumed run continues the same tracked run."""
    wandb_project: str = "fsdp-lm"
    """Weights & Biases project (logging.trackers: [wandb]); the W&B run is named after run.name."""
    wandb_entity: str = ""
    """Weights & Biases entity (user or team); empty: the logged-in user's default."""
    wandb_mode: Literal["", "online", "offline", "disabled"] = ""
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
    profile_steps: list[int] = field(default_factory=list)
    """[start, end]: record a torch.profiler trace of training steps start..end (1-based, both included) into
    <output_dir>/profile/steps<start>-<end>/rank<r>.pt.trace.json (Perfetto, chrome://tracing, TensorBoard's
    profiler plugin); [] for none."""
    profile_ranks: Literal["rank0", "all"] = "rank0"
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
    def peak_override_flops(self) -> float:
        """The configured peak in FLOP/s (0: look the GPU up)."""
        return self.peak_tflops * 1e12


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
        """The config as plain data, for config.yaml and the trackers: every URL in it (data.files,
        logging.mlflow_tracking_uri, ...) without a user, password or query string, which may be credentials."""
        return without_credentials(dataclasses.asdict(self))
