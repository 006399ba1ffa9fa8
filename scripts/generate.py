"""Sample text from a training checkpoint on one device (no process group).

    python scripts/generate.py checkpoints/tiny/fsdp_cpt1000.pth --prompt "def main(" --max_new_tokens 60
    python scripts/generate.py checkpoints/llama1B/fsdp_sharded_cpt500 --prompt "import " --temperature 0   # greedy
    python scripts/generate.py CKPT --prompt "class " --top_k 20 --seed 7 --device cuda --tokenizer my.model

Prints the prompt followed by the continuation. The tokenizer is the run's SentencePiece model, found
next to the checkpoint by the hash the checkpoint records (train_fsdp.py copies it there). Sampling:
logits / temperature, keep the top_k most likely tokens (0: all), draw with a torch.Generator seeded by
--seed, so a fixed seed gives the same text; --temperature 0 is greedy and ignores the seed. The context
is cropped to the model's max_seq_len; generation stops early at the end-of-document token. An empty
prompt starts a fresh document.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fsdp_utils.checkpoint.format import CheckpointError  # noqa: E402
from fsdp_utils.checkpoint.io import find_tokenizer, load_model, read_meta  # noqa: E402
from model import Transformer  # noqa: E402

MIN_TEMPERATURE = 1e-6


class GenerateError(Exception):
    """A problem with the arguments or the tokenizer; the message says what to change."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise GenerateError("--device cuda: no CUDA device available")
    return torch.device(name)


@torch.no_grad()
def sample(model: Transformer, context: list[int], *, max_new_tokens: int, temperature: float, top_k: int,
           generator: torch.Generator, vocab_limit: int, stop_id: int | None = None) -> list[int]:
    """The new token ids after `context`; only ids below vocab_limit (the tokenizer's size) are drawn."""
    device = model.rope_cos.device
    tokens = list(context)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([tokens[-model.cfg.max_seq_len:]], device=device)
        logits = model(window)[0, -1, :vocab_limit].float()
        if temperature == 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                threshold = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            next_id = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        if next_id == stop_id:
            break
        tokens.append(next_id)
        new.append(next_id)
    return new


def argument_problems(*, max_new_tokens: int, temperature: float, top_k: int, seed: int) -> list[str]:
    """Every sampling argument outside its range, phrased for the command line."""
    problems = []
    if max_new_tokens <= 0:
        problems.append(f"--max_new_tokens must be positive, got {max_new_tokens}")
    # Below MIN_TEMPERATURE sampling is greedy in effect, and far below it logits / temperature overflow to inf.
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):  # also refuses nan
        problems.append(f"--temperature must be 0 (greedy) or a finite number of at least {MIN_TEMPERATURE:g}, "
                        f"got {temperature}")
    if top_k < 0:
        problems.append(f"--top_k must be 0 (all tokens) or positive, got {top_k}")
    if not 0 <= seed < 2**63:
        problems.append(f"--seed must be in [0, 2**63 - 1], got {seed}")
    return problems


def generate(checkpoint: Path, prompt: str, *, max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 50,
             seed: int = 0, device: str = "auto", tokenizer: Path | None = None) -> str:
    """prompt + the sampled continuation."""
    import sentencepiece as spm

    if problems := argument_problems(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed):
        raise GenerateError("; ".join(problems))
    meta = read_meta(checkpoint)  # first: a missing or foreign checkpoint is the error to report
    tokenizer = find_tokenizer(checkpoint, tokenizer, meta.get("tokenizer_sha256"))  # the one it was trained with
    if tokenizer.is_dir():
        raise GenerateError(f"{tokenizer}: a Hugging Face tokenizer (data.tokenizer=hf); this script samples with "
                            f"SentencePiece tokenizers only: export the checkpoint with scripts/export_hf.py and "
                            f"generate with transformers")
    try:
        sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    except (OSError, RuntimeError) as err:
        raise GenerateError(f"{tokenizer}: not a SentencePiece model ({err})") from None
    dev = pick_device(device)
    model, _ = load_model(checkpoint, device=dev)
    if sp.get_piece_size() > model.cfg.vocab_size:
        raise GenerateError(f"{tokenizer}: {sp.get_piece_size()} pieces, more than the model's "
                            f"vocab_size={model.cfg.vocab_size}")
    eos = sp.eos_id() if sp.eos_id() >= 0 else None
    context = sp.encode(prompt) or ([eos] if eos is not None else [])
    if not context:
        raise GenerateError("the prompt is empty and the tokenizer has no end-of-document token to start from")
    generator = torch.Generator(device=dev)
    generator.manual_seed(seed)
    new = sample(model, context, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                 generator=generator, vocab_limit=sp.get_piece_size(), stop_id=eos)
    return prompt + sp.decode(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="fsdp_cpt<step>.pth or fsdp_sharded_cpt<step>/")
    parser.add_argument("--prompt", required=True, help="text to continue (may be empty)")
    parser.add_argument("--max_new_tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="SentencePiece model (default: the one next to CHECKPOINT that it was trained with)")
    args = parser.parse_args(argv)
    try:
        text = generate(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, seed=args.seed, device=args.device, tokenizer=args.tokenizer)
    except (GenerateError, CheckpointError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
