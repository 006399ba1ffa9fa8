"""Evaluate a checkpoint on lm-evaluation-harness tasks (EleutherAI's lm-eval package), without exporting it.

    python scripts/evaluate.py checkpoints/tiny/fsdp_cpt1000.pth --tasks python_next_line \\
        --include_path scripts/eval_tasks --output results.json
    torchrun --nproc_per_node=8 scripts/evaluate.py checkpoints/llama1B/fsdp_sharded_cpt500 --tasks hellaswag,arc_easy
    python scripts/evaluate.py exported/tiny --tasks lambada_openai --limit 100 --device cpu   # an HF model folder

CHECKPOINT is a full checkpoint, a sharded folder or a Hugging Face model folder. Under torchrun every rank holds the
whole model and evaluates its share of the batches; rank 0 prints the table and writes --output (docs/evaluation.md)."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from config.numbers import integer
from fsdp_utils.checkpoint.errors import CheckpointError
from fsdp_utils.checkpoint.io import find_tokenizer, load_model, read_meta
from fsdp_utils.distributed import destroy_distributed, init_distributed, pick_device, read_torchrun_env
from fsdp_utils.evaluation.downstream import (
    DownstreamError,
    flat_metrics,
    load_tasks,
    run_tasks,
    task_manager,
    task_problems,
)
from fsdp_utils.parallel.hf import (
    CausalLMAdapter,
    HFModelError,
    HFSource,
    load_hf_checkpoint,
    load_pretrained,
)
from safe_io import nofollow

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Autocast(nn.Module):
    """Runs the model under autocast: bf16 matmuls, weights, norms and the rotary tables kept in fp32."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(tokens.device.type, dtype=self.dtype):
            return self.module(tokens)


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def load_for_eval(path: Path, *, device: torch.device, tokenizer: Path | None, base: Path | None = None):
    """(model returning logits, codec, max_length, a short description) for a checkpoint (of our model, or of a
    fine-tuned Hugging Face one: `base` as for load_hf_checkpoint) or an HF folder."""
    from lm_eval.models.utils import resolve_max_length

    from fsdp_utils.evaluation.lm_eval_model import open_codec

    if is_hf_folder(path):
        lm = load_pretrained(HFSource(hf_path=str(path)))
        codec = open_codec("hf", tokenizer or path)
        return CausalLMAdapter(lm).to(device).eval(), codec, resolve_max_length(lm.config, codec.tok), "hf"
    meta = read_meta(path)  # first: a missing or foreign checkpoint is the error to report
    tokenizer = find_tokenizer(path, tokenizer, meta.get("tokenizer_sha256"))
    codec = open_codec("hf" if tokenizer.is_dir() else "sentencepiece", tokenizer)
    if meta["model_config"].get("type") == "hf":  # a fine-tuned Hugging Face model: its architecture's context
        adapter, _, _ = load_hf_checkpoint(path, base=base)
        model, vocab_size = adapter.to(device), adapter.lm.config.vocab_size
        max_length, kind = resolve_max_length(adapter.lm.config, codec.tok), "hf checkpoint"
    else:
        model, _ = load_model(path, device=device)
        vocab_size, max_length, kind = model.cfg.vocab_size, model.cfg.max_seq_len, "ours"
    if codec.vocab_size > vocab_size:
        raise DownstreamError(f"{tokenizer}: {codec.vocab_size} tokens, more than the model's vocab_size={vocab_size}")
    return model, codec, max_length, kind


def evaluate(checkpoint: Path, tasks: list[str], *, include_path: list[str], limit: int | None = None,
             batch_size: int = 8, num_fewshot: int | None = None, device: str = "auto", dtype: str = "auto",
             tokenizer: Path | None = None, bootstrap_iters: int = 100_000, base: Path | None = None) -> dict:
    """lm_eval's results for `tasks` (every rank gets them), with an 'evaluation' entry: what ran, where, how long."""
    from fsdp_utils.evaluation.lm_eval_model import ModelLM

    launch = read_torchrun_env()
    env_device = init_distributed(device=device).device if launch.world_size > 1 else pick_device(device, 0)
    compute = DTYPES[dtype] if dtype != "auto" else torch.bfloat16 if env_device.type == "cuda" else torch.float32
    started = time.perf_counter()
    manager = task_manager(tasks, include_path)
    task_dict = load_tasks(manager, tasks, num_fewshot=num_fewshot)
    model, codec, max_length, kind = load_for_eval(checkpoint, device=env_device, tokenizer=tokenizer, base=base)
    if compute != torch.float32:
        model = Autocast(model, compute)
    loaded = time.perf_counter()
    lm = ModelLM(model, codec, device=env_device, batch_size=batch_size, max_length=max_length,
                 progress=launch.rank == 0)
    # lm_eval's progress bars from rank 0 alone.
    with contextlib.redirect_stderr(io.StringIO()) if launch.rank else contextlib.nullcontext():
        results = run_tasks(lm, task_dict, limit=limit, bootstrap_iters=bootstrap_iters)
    done = time.perf_counter()
    results["evaluation"] = {
        "checkpoint": str(checkpoint), "model": kind, "tasks": tasks, "limit": limit, "num_fewshot": num_fewshot,
        "batch_size": batch_size, "max_length": max_length, "world_size": launch.world_size,
        "device": str(torch.cuda.get_device_name(env_device) if env_device.type == "cuda" else "cpu"),
        "dtype": str(compute).replace("torch.", ""), "load_s": loaded - started, "eval_s": done - loaded,
        "forward_passes_rank0": lm.num_forward, "metrics": flat_metrics(results),
    }
    return results


def output_problem(path: Path) -> str | None:
    """Why the results could not be written to --output `path`, or None: checked before evaluating, whose results
    would otherwise be lost at its end. It must be a regular file, which is replaced, or a new name in a folder
    this process may write into (the results are written beside it first, then renamed into place)."""
    try:
        kind = nofollow.kind_at(path)
    except OSError as err:
        return f"--output {path}: {err.strerror or err}"
    if kind not in (None, "a file"):
        return f"--output {path}: {kind}, not a file to write the results to"
    folder = path.parent
    if not folder.is_dir():
        return f"--output {path}: the folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"--output {path}: the folder {folder} is not writable"
    return None


def report(results: dict) -> str:
    """lm_eval's table of the results, then one line with the time taken."""
    from lm_eval.utils import make_table

    e = results["evaluation"]
    return (make_table(results) + f"\n{len(e['tasks'])} task(s) on {e['world_size']} x {e['device']} ({e['dtype']}): "
            f"loaded in {e['load_s']:.1f} s, evaluated in {e['eval_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="fsdp_cpt<step>.pth, fsdp_sharded_cpt<step>/ or an HF folder")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names or task .yaml files")
    parser.add_argument("--include_path", action="append", default=[], help="a folder of task .yaml files (repeatable)")
    parser.add_argument("--limit", type=integer, default=None, help="the first N documents of each task")
    parser.add_argument("--batch_size", type=integer, default=8, help="sequences per forward pass")
    parser.add_argument("--num_fewshot", type=integer, default=None,
                        help="few-shot examples (default: each task's own)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: bf16 on GPUs, else fp32")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="SentencePiece model (default: the one next to CHECKPOINT that it was trained with)")
    parser.add_argument("--base", type=Path, default=None,
                        help="a checkpoint of a fine-tuned Hugging Face model: the model folder (or config.json) it "
                             "fine-tuned (default: model.hf_path or model.hf_config of the run's config.yaml)")
    parser.add_argument("--bootstrap_iters", type=integer, default=100_000, help="for standard errors (0: none)")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    problems = task_problems(tasks, args.include_path, where="--tasks") if tasks else ["--tasks: no task named"]
    problems += [f"--{name} must be positive, got {value}" for name, value in
                 (("limit", args.limit), ("batch_size", args.batch_size)) if value is not None and value <= 0]
    if args.output is not None and (problem := output_problem(args.output)):
        problems.append(problem)
    if problems:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    try:
        results = evaluate(args.checkpoint, tasks, include_path=args.include_path, limit=args.limit,
                           batch_size=args.batch_size, num_fewshot=args.num_fewshot, device=args.device,
                           dtype=args.dtype, tokenizer=args.tokenizer, bootstrap_iters=args.bootstrap_iters,
                           base=args.base)
        if read_torchrun_env().rank == 0:
            print(report(results))
            if args.output is not None:
                from lm_eval.utils import handle_non_serializable

                text = json.dumps(results, indent=2, default=handle_non_serializable) + "\n"
                nofollow.write_beside(args.output, lambda f: f.write(text.encode()))
    except (DownstreamError, CheckpointError, HFModelError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
