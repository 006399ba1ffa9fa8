"""Our models as an lm-evaluation-harness `LM`: loglikelihood, loglikelihood_rolling and generate_until over
any module whose forward(tokens (B, T)) returns logits (B, T, V) (our Transformer, a Hugging Face model's
CausalLMAdapter, either of them sharded by FSDP1 or FSDP2), with the run's tokenizer.

Imports lm_eval at the top: import this module only when evaluating (fsdp_utils/evaluation/downstream.py does).

Several ranks: lm_eval is told it runs in one process (rank 0 of 1), so every rank builds every request and
computes the metrics itself; the forward passes are split here. The requests are sorted and batched alike on
every rank, batch i goes to rank i mod world size, and every rank runs as many forward passes as the busiest
one (a rank without work runs a one-row pass): a sharded model needs every rank in every forward pass. The
results are gathered to every rank.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

log = logging.getLogger(__name__)

# Inputs are right-padded to a multiple of this many tokens: fewer shapes for torch.compile to specialise
# on, and FP8 matmuls need token counts divisible by 16. Right padding cannot change a causal model's
# outputs at the real positions.
PAD_MULTIPLE = 64
DEFAULT_MAX_GEN_TOKS = 256
R = TypeVar("R")


class SentencePieceCodec:
    """The run's SentencePiece model, used as in training: no BOS; documents end with EOS, so a text with
    no context is conditioned on EOS (the start of a document)."""

    def __init__(self, path: str | Path):
        from data.tokenizer import load_sentencepiece

        self.sp = load_sentencepiece(Path(path))  # a DataError (a ValueError) in one line for anything but one
        self.eos_id = self.prefix_id = self.sp.eos_id()
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, text: str, *, special: bool | None = None) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


class HFCodec:
    """A Hugging Face tokenizer folder, used as lm_eval's HFLM uses it: its own special tokens (a BOS where
    it adds one), BOS (else EOS) before a text with no context, special tokens dropped when decoding."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        if self.tok.eos_token_id is None:
            raise ValueError(f"{path}: the tokenizer has no EOS token")
        self.eos_id = self.tok.eos_token_id
        self.prefix_id = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.eos_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str, *, special: bool | None = None) -> list[int]:
        if special is None and self.tok.bos_token and text.startswith(self.tok.bos_token):
            special = False  # the text brings its own BOS
        kwargs = {} if special is None else {"add_special_tokens": special}
        return self.tok.encode(text, **kwargs)

    def decode(self, ids: list[int]) -> str:
        text = self.tok.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str), "one sequence of ids decodes to one string"
        return text


Codec = SentencePieceCodec | HFCodec


def open_codec(kind: str, path: str | Path) -> Codec:
    """kind 'hf': a tokenizer folder; otherwise a SentencePiece .model file."""
    return HFCodec(path) if kind == "hf" else SentencePieceCodec(path)


@dataclass
class _Generation:
    index: int
    context: list[int]
    max_new: int
    until: list[str]


class ModelLM(TemplateLM):
    """lm_eval's LM over `model` (in eval mode, on `device`) and `codec`. Contexts longer than max_length
    lose tokens on the left, as in lm_eval's own models (so does a continuation longer than max_length, which
    those refuse: a training run should not stop for one); generation is greedy, without a KV cache (each new
    token runs the model over the whole sequence), for the short answers of evaluation tasks."""

    def __init__(self, model: nn.Module, codec: Codec, *, device: torch.device, batch_size: int, max_length: int,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, progress: bool = False):
        super().__init__()
        self.model, self.codec, self._device = model, codec, device
        self.batch_size, self.max_length, self.max_gen_toks = batch_size, max_length, max_gen_toks
        self.progress = progress
        # lm_eval's own rank and world size stay 0 and 1 (see the module docstring): ours are these.
        self.eval_rank, self.eval_world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.num_forward = 0  # forward passes this rank ran (the tests check that every rank ran as many)

    @property
    def eot_token_id(self) -> int:
        return self.codec.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.codec.prefix_id

    @property
    def tokenizer_name(self) -> str:
        return type(self.codec).__name__

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.codec.encode(string, special=add_special_tokens)

    # ---- the three request types -------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=not self.progress)

    def _loglikelihood_tokens(self, requests, **kwargs: Any) -> list[tuple[float, bool]]:
        return self.score([(context, continuation) for _, context, continuation in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability as windows of max_length tokens, every token predicted once, the
        first from the prefix token (lm_eval's rolling windows)."""
        owners, pairs = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            windows = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                owners.append(i)
                pairs.append((context, continuation))
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.score(pairs), strict=True):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs, notes = [], set()
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample") and kwargs.get("temperature", 0.0) > 0:
                notes.add("sampling (do_sample) was asked for: decoded greedily instead")
            max_new = int(kwargs["max_gen_toks"])
            if max_new >= self.max_length:
                notes.add(f"max_gen_toks={max_new} leaves no room for a context in {self.max_length} tokens: "
                          f"{self.max_length - 1} new tokens at most")
                max_new = self.max_length - 1
            until = kwargs.get("until") or []
            jobs.append(_Generation(i, self.tok_encode(context)[-(self.max_length - max_new):], max_new,
                                    [until] if isinstance(until, str) else list(until)))
        for note in sorted(notes) if self.eval_rank == 0 else []:
            log.warning("generate_until: %s", note)
        jobs.sort(key=lambda job: -len(job.context))
        batches = [jobs[i:i + self.batch_size] for i in range(0, len(jobs), self.batch_size)]
        texts = self._across_ranks(batches, self._generate)
        return [texts[i] for i in range(len(requests))]

    # ---- scoring --------------------------------------------------------------------------------------
    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """For each (context, continuation) of token ids: the continuation's log-probability after the
        context, and whether greedy decoding would produce it (an empty continuation: 0 and True)."""
        rows, num_cut = [], 0
        for context, continuation in pairs:
            if len(continuation) > self.max_length:  # no room for it: its first tokens go, as a context's would
                continuation, num_cut = continuation[-self.max_length:], num_cut + 1
            whole = (context + continuation)[-(self.max_length + 1):]
            rows.append((whole[:-1], continuation))  # the model reads whole[:-1] and predicts whole[1:]
        if num_cut and self.eval_rank == 0:
            log.warning("%d continuation(s) longer than the %d-token context: only their last %d tokens were scored",
                        num_cut, self.max_length, self.max_length)
        # Longest first: a batch is padded to its first row's length, so similar lengths share batches.
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]

        def run(batch: list[int]) -> list[tuple[int, tuple[float, bool]]]:
            if not batch:
                self._idle_forward()
                return []
            logits = self._logits([rows[i][0] for i in batch])  # (B, T, V)
            sums, greedy = [], []
            for j, i in enumerate(batch):
                inputs, continuation = rows[i]
                n = len(continuation)
                logprobs = torch.log_softmax(logits[j, len(inputs) - n:len(inputs)].float(), dim=-1)  # (n, V)
                target = torch.tensor(continuation, device=logprobs.device)
                sums.append(logprobs.gather(1, target[:, None]).sum())
                greedy.append((logprobs.argmax(-1) == target).all())
            # One copy to the host per batch, not one per row.
            values = torch.stack(sums).tolist(), torch.stack(greedy).tolist()
            return [(i, (value, hit)) for i, value, hit in zip(batch, *values, strict=True)]

        results = self._across_ranks(batches, run)
        return [results[i] for i in range(len(rows))]

    # ---- generation -------------------------------------------------------------------------------------
    def _generate(self, jobs: list[_Generation]) -> list[tuple[int, str]]:
        """Greedy continuations of a batch, stopped at EOS, at max_new tokens, or once a stop string appears
        (cut off there). Every rank steps together while any rank still generates."""
        rows = [list(job.context) for job in jobs]
        new: list[list[int]] = [[] for _ in jobs]
        active = [i for i, job in enumerate(jobs) if job.max_new > 0]
        while self._any_rank(bool(active)):
            if not active:
                self._idle_forward()
                continue
            logits = self._logits([rows[i] for i in active])  # (b, T, V)
            last = torch.tensor([len(rows[i]) - 1 for i in active], device=logits.device)
            # Only ids the tokenizer knows: a model's vocabulary may be padded past it.
            vocab = min(self.codec.vocab_size, logits.shape[-1])
            picks = logits[torch.arange(len(active), device=logits.device), last, :vocab].argmax(-1).tolist()
            still = []
            for i, token in zip(active, picks, strict=True):
                if token == self.codec.eos_id:
                    continue
                rows[i].append(token)
                new[i].append(token)
                stopped = any(s and s in self.codec.decode(new[i]) for s in jobs[i].until)
                if not stopped and len(new[i]) < jobs[i].max_new:
                    still.append(i)
            active = still
        return [(job.index, postprocess_generated_text(self.codec.decode(new[i]), job.until, None))
                for i, job in enumerate(jobs)]

    # ---- forward passes and the ranks ----------------------------------------------------------------------
    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """The model's logits (B, T, V) for rows of token ids, right-padded with EOS."""
        length = min(math.ceil(max(1, *map(len, rows)) / PAD_MULTIPLE) * PAD_MULTIPLE, self.max_length)
        tokens = torch.full((len(rows), length), self.codec.eos_id, dtype=torch.long)
        for j, row in enumerate(rows):
            tokens[j, :len(row)] = torch.tensor(row, dtype=torch.long)
        self.num_forward += 1
        return self.model(tokens.to(self._device))

    def _idle_forward(self) -> None:
        """A one-row pass whose output is dropped, for a rank without work while others have some."""
        if self.eval_world > 1:
            self._logits([[self.codec.eos_id]])

    def _any_rank(self, flag: bool) -> bool:
        if self.eval_world == 1:
            return flag
        value = torch.tensor(int(flag), device=self._device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _across_ranks(self, batches: list[list], run: Callable[[list], list[tuple[int, R]]]) -> dict[int, R]:
        """run(batch) for batch i on rank i mod world size, run([]) where a rank has none left in a round;
        every rank gets every (index, result)."""
        mine = batches[self.eval_rank::self.eval_world]
        rounds = math.ceil(len(batches) / self.eval_world)
        local: list[tuple[int, R]] = []
        for k in range(rounds):
            local += run(mine[k] if k < len(mine) else [])
        if self.eval_world == 1:
            return dict(local)
        gathered: list[list[tuple[int, R]] | None] = [None] * self.eval_world
        dist.all_gather_object(gathered, local)
        return {i: r for part in gathered for i, r in (part or [])}
