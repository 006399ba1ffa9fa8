"""Sample text from a training checkpoint on one device (no process group).

    python scripts/generate.py checkpoints/tiny/fsdp_cpt1000.pth --prompt "def main(" --max_new_tokens 60
    python scripts/generate.py checkpoints/llama1B/fsdp_sharded_cpt500 --prompt "import " --temperature 0   # greedy
    python scripts/generate.py checkpoints/finetune_chat/fsdp_sharded_cpt1000 --prompt "Hello" --chat

Prints the prompt followed by the continuation, from our model, a fine-tuned Hugging Face model (--base), or LoRA
adapters on the base the checkpoint records, with the run's tokenizer found next to the checkpoint by its hash.
--chat renders the prompt as a user turn with the tokenizer's chat template (or data/chat.py's PLAIN one).
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from config.numbers import integer, number
from data.chat import PLAIN_END, plain_prompt
from data.errors import DataError
from data.tokenizer import load_sentencepiece
from fsdp_utils.checkpoint.errors import CheckpointError
from fsdp_utils.checkpoint.io import find_tokenizer, load_model, read_meta
from fsdp_utils.parallel.hf import CausalLMAdapter, HFModelError, load_hf_checkpoint

MIN_TEMPERATURE = 1e-6


class GenerateError(Exception):
    """A problem with the arguments or the tokenizer; the message says what to change."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise GenerateError("--device cuda: no CUDA device available")
    return torch.device(name)


def context_length(model: nn.Module) -> int | None:
    """The most tokens the model attends to: our max_seq_len, or a Hugging Face config's max_position_embeddings."""
    if isinstance(model, CausalLMAdapter):
        return getattr(model.lm.config, "max_position_embeddings", None)
    return int(model.cfg.max_seq_len)  # type: ignore[union-attr]  # our Transformer


@torch.no_grad()
def sample(model: nn.Module, context: list[int], *, max_new_tokens: int, temperature: float, top_k: int,
           generator: torch.Generator, vocab_limit: int, stop_id: int | None = None,
           until: Callable[[list[int]], bool] | None = None) -> list[int]:
    """The new token ids after `context`; only ids below vocab_limit (the tokenizer's size) are drawn, until stop_id
    is drawn (not kept) or until(the new ids) holds. `model` maps tokens (B, T) to logits (B, T, V): our
    Transformer, or a Hugging Face model's CausalLMAdapter."""
    device = next(model.parameters()).device
    window_len = context_length(model)
    tokens = list(context)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([tokens[-window_len:] if window_len else tokens], device=device)
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
        if until is not None and until(new):
            break
    return new


@dataclass
class TextCodec:
    """The run's tokenizer as generation uses it."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    size: int
    eos_id: int | None
    chat: Callable[[str], list[int]]  # the prompt as a user message, then the start of the assistant's turn
    chat_end: str | None  # the text that ends the assistant's turn (PLAIN_END), where no token of its own does


def open_tokenizer(path: Path) -> TextCodec:
    """A SentencePiece model file, or a Hugging Face tokenizer folder (data.tokenizer=hf)."""
    if path.is_dir():
        from data.hf_tokenizer import HFTokenizer

        try:
            hf = HFTokenizer(path)
        except ValueError as err:
            raise GenerateError(f"{path}: not a usable Hugging Face tokenizer folder ({err})") from None
        tok = hf.tok

        def chat(prompt: str) -> list[int]:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            return tok(text, add_special_tokens=False)["input_ids"]  # the template writes its own special tokens

        own = hf.has_chat_template()  # without one, chat data was prepared with the PLAIN template
        return TextCodec(lambda text: hf.encode([text])[0], tok.decode, hf.get_piece_size(), hf.eos_id(),
                         chat if own else plain_chat(hf.encode), None if own else PLAIN_END)
    try:
        sp = load_sentencepiece(path, need_eos=False)
    except DataError as err:
        raise GenerateError(str(err)) from None
    return TextCodec(sp.encode, sp.decode, sp.get_piece_size(), sp.eos_id() if sp.eos_id() >= 0 else None,
                     plain_chat(sp.encode), PLAIN_END)


def plain_chat(encode: Callable) -> Callable[[str], list[int]]:
    """The prompt as a user message, then the assistant's header, with the PLAIN template (data/chat.py): what chat
    training data is rendered with for a tokenizer without a chat template of its own."""
    return lambda prompt: plain_prompt(encode, [{"role": "user", "content": prompt}])


def load_for_generation(checkpoint: Path, meta: dict, *, device: torch.device,
                        base: Path | None) -> tuple[nn.Module, int]:
    """(the checkpoint's model on `device`, in eval mode; its vocabulary size). A LoRA checkpoint's adapters
    are put on the base the checkpoint records, as scripts/export_hf.py --merge_lora finds and checks it."""
    if "lora" in meta:
        from scripts.export_hf import load_lora_model

        model, _ = load_lora_model(checkpoint)
        lm = getattr(model, "lm", None)  # a Hugging Face model's CausalLMAdapter
        return model.to(device), lm.config.vocab_size if lm is not None else model.cfg.vocab_size
    if meta["model_config"].get("type") == "hf":
        adapter, _, _ = load_hf_checkpoint(checkpoint, base=base)
        return adapter.to(device), adapter.lm.config.vocab_size
    model, _ = load_model(checkpoint, device=device)
    return model, model.cfg.vocab_size


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


def prompt_tokens(codec: TextCodec, prompt: str, *, chat: bool) -> list[int]:
    """The context to continue: the prompt as a document (an empty one starts at EOS), or as a chat turn."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:  # bytes of the command line that are not UTF-8 (surrogate escapes)
        raise GenerateError(f"--prompt is not valid UTF-8 text (at character {err.start})") from None
    if chat:
        return codec.chat(prompt)
    context = codec.encode(prompt) or ([codec.eos_id] if codec.eos_id is not None else [])
    if not context:
        raise GenerateError("the prompt is empty and the tokenizer has no end-of-document token to start from")
    return context


def generate(checkpoint: Path, prompt: str, *, max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 50,
             seed: int = 0, device: str = "auto", tokenizer: Path | None = None, base: Path | None = None,
             chat: bool = False) -> str:
    """prompt + the sampled continuation."""
    if problems := argument_problems(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed):
        raise GenerateError("; ".join(problems))
    meta = read_meta(checkpoint)  # first: a missing or foreign checkpoint is the error to report
    tokenizer = find_tokenizer(checkpoint, tokenizer, meta.get("tokenizer_sha256"))  # the one it was trained with
    codec = open_tokenizer(tokenizer)
    context = prompt_tokens(codec, prompt, chat=chat)
    dev = pick_device(device)
    model, vocab_size = load_for_generation(checkpoint, meta, device=dev, base=base)
    if codec.size > vocab_size:
        raise GenerateError(f"{tokenizer}: {codec.size} tokens, more than the model's vocab_size={vocab_size}")
    generator = torch.Generator(device=dev)
    generator.manual_seed(seed)
    end = codec.chat_end if chat else None
    until = (lambda new: end in codec.decode(new)) if end else None
    new = sample(model, context, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                 generator=generator, vocab_limit=codec.size, stop_id=codec.eos_id, until=until)
    text = codec.decode(new)
    return prompt + (text.split(end)[0] if end else text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="fsdp_cpt<step>.pth or fsdp_sharded_cpt<step>/")
    parser.add_argument("--prompt", required=True, help="text to continue (may be empty)")
    parser.add_argument("--max_new_tokens", type=integer, default=100)
    parser.add_argument("--temperature", type=number, default=0.8, help="0: greedy")
    parser.add_argument("--top_k", type=integer, default=50, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--seed", type=integer, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a SentencePiece model or a Hugging Face tokenizer folder (default: the one next to "
                             "CHECKPOINT that it was trained with)")
    parser.add_argument("--chat", action="store_true",
                        help="render the prompt as a user message with the tokenizer's chat template (or the PLAIN "
                             "template of data/chat.py)")
    parser.add_argument("--base", type=Path, default=None,
                        help="a checkpoint of a fine-tuned Hugging Face model: the model folder (or config.json) it "
                             "fine-tuned (default: model.hf_path or model.hf_config of the run's config.yaml)")
    args = parser.parse_args(argv)
    try:
        text = generate(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, seed=args.seed, device=args.device, tokenizer=args.tokenizer,
                        base=args.base, chat=args.chat)
    except (GenerateError, CheckpointError, HFModelError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
