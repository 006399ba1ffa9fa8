"""Fine-tuning data (data.format: chat): rendering and masks (our PLAIN template, and a transformers
tokenizer's own template with and without {% generation %} tags), preparation into the token and mask
stores (worker-count independent, bad records, resumable folders), the loader's masked targets, the loss
over trained targets only, and its normalisation over the whole global batch (micro-batches and ranks).
The tokenizers are built here, in-process; nothing is downloaded."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from config import ConfigError, load_config
from data import DataError, PrepareSettings, load_prepared, prepare_data
from data.chat import PLAIN_END, ChatFields, canonical_text, conversation, plain_text, render_plain
from data.loader import IGNORE_INDEX, TokenDataset
from model.loss import chunked_cross_entropy
from tests.distributed_harness import run_ranks
from tests.helpers import ROOT, failing_after, job_env
from tests.test_data import held_out

transformers = pytest.importorskip("transformers")

WORDS = "alpha beta gamma delta epsilon zeta theta lambda sigma omega".split()
SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>", "<eot>", "<eos>", "<unk>"]
# Our own templates for the test tokenizer: every part is a whitespace-separated word, so the expected tokens
# and their mask can be written down from the messages alone (expected_words below).
TEMPLATE_INCREMENTAL = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% if m.role == 'assistant' %}<eot> {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
TEMPLATE_GENERATION = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|> {% generation %}{{ m.content }} <eot>"
    "{% endgeneration %} {% else %}<|{{ m.role }}|> {{ m.content }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def make_conversations(num: int, *, seed: int = 0) -> list[dict]:
    """Records of both kinds: multi-turn messages with a system prompt, and prompt/response pairs."""
    rng = np.random.default_rng(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS, size=n))

    records = []
    for i in range(num):
        if i % 3 == 0:
            records.append({"prompt": words(3), "response": words(int(rng.integers(1, 6)))})
        else:
            records.append({"messages": [
                {"role": "system", "content": words(2)}, {"role": "user", "content": words(4)},
                {"role": "assistant", "content": words(int(rng.integers(1, 8)))},
                {"role": "user", "content": words(2)}, {"role": "assistant", "content": words(3)}]})
    return records


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def word_tokenizer(template: str):
    """A fast (Rust) word-level tokenizer: one token per whitespace-separated word, the specials included."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                                                additional_special_tokens=SPECIALS[:4])
    fast.chat_template = template
    return fast


def expected_words(messages: list[dict]) -> tuple[list[str], list[int]]:
    """What both test templates render, word by word, and which words are the assistant's (content and <eot>)."""
    words, mask = [], []
    for m in messages:
        assistant = m["role"] == "assistant"
        content = m["content"].split()
        words += [f"<|{m['role']}|>", *content] + (["<eot>"] if assistant else [])
        mask += [0] + [int(assistant)] * (len(content) + assistant)
    return words, mask


# ---- rendering --------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", [TEMPLATE_INCREMENTAL, TEMPLATE_GENERATION], ids=["incremental", "generation"])
def test_tokenizer_template_masks_exactly_the_assistant_tokens(template):
    from data.chat import render_template

    tok = word_tokenizer(template)
    for record in make_conversations(6, seed=3):
        messages = conversation(record, ChatFields())
        ids, mask = render_template(tok, messages)
        words, want_mask = expected_words(messages)
        assert ids == tok.convert_tokens_to_ids(words)
        assert mask == want_mask


def test_template_that_renders_prefixes_differently_is_refused():
    from data.chat import TemplateNotIncremental, render_template

    # The last message is rendered with a marker the earlier ones lack: prefixes are not prefixes of the whole.
    template = TEMPLATE_INCREMENTAL.replace("{% endfor %}", "{% if loop.last %}<eos> {% endif %}{% endfor %}")
    messages = conversation(make_conversations(2)[1], ChatFields())
    with pytest.raises(TemplateNotIncremental, match="generation"):
        render_template(word_tokenizer(template), messages)


def test_plain_template_masks_the_assistant_content_and_end_marker():
    # A character-level "tokenizer" (one id per character) puts every character of the rendered text at its
    # own position, so the expected mask is the assistant spans found in the text by string search.
    messages = conversation(make_conversations(2)[1], ChatFields())
    ids, mask = render_plain(lambda texts: [[ord(c) for c in text] for text in texts], messages)
    text = plain_text(messages)
    assert "".join(map(chr, ids)) == text
    want = np.zeros(len(text), dtype=int)
    position = 0
    for m in messages:
        if m["role"] == "assistant":
            trained = m["content"] + PLAIN_END
            position = text.index("<|assistant|>\n" + trained, position) + len("<|assistant|>\n")
            want[position : position + len(trained)] = 1
    assert mask == want.tolist()
    assert text.startswith("<|system|>\n") and text.endswith(PLAIN_END + "\n")


def test_a_plain_prompt_is_the_training_tokens_before_the_assistants_reply():
    """generate.py --chat with a SentencePiece tokenizer: the context is what the training data held before the
    assistant's content, token for token (each part tokenised on its own, as render_plain does)."""
    import sentencepiece as spm

    from data.chat import plain_prompt

    sp = spm.SentencePieceProcessor(model_file=str(ROOT / "tests/fixtures/checkpoints_2026_12/tokenizer.model"))
    messages = conversation(make_conversations(2)[1], ChatFields())
    for turn in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        ids, mask = render_plain(sp.encode, messages[: turn + 1])
        prompt = plain_prompt(sp.encode, messages[:turn])
        assert prompt == ids[: len(prompt)] and mask[len(prompt) - 1 : len(prompt) + 1] == [0, 1]  # the reply next
        assert sp.decode(prompt) == plain_text(messages[:turn]) + "<|assistant|>\n"


@pytest.mark.parametrize("record,problem", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "role"),
    ({"messages": []}, "non-empty list"),
    ({"prompt": "hi"}, "expected a list 'messages'"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "starts with the assistant"),
])
def test_bad_conversations_say_why(record, problem):
    from data.chat import BadConversation

    with pytest.raises(BadConversation, match=problem):
        conversation(record, ChatFields())


# ---- preparation and loading ------------------------------------------------------------------------


def chat_settings(path: Path, **kwargs) -> PrepareSettings:
    return PrepareSettings(**{"files": (str(path),), "vocab_size": 300, "val_fraction": 0.1, "seed": 7,
                              "format": "chat", "num_workers": 0} | kwargs)


def hf_tokenizer(tmp_path: Path) -> dict:
    """The settings of a Hugging Face tokenizer saved in tmp_path/hf."""
    return {"tokenizer": "hf", "hf_tokenizer": str(tmp_path / "hf")}


def read_split(prepared, split: str) -> tuple[np.ndarray, np.ndarray]:
    files = prepared.train_files if split == "train" else prepared.val_files
    masks = prepared.train_mask_files if split == "train" else prepared.val_mask_files
    return (np.concatenate([np.fromfile(f, dtype=prepared.dtype) for f in files]),
            np.concatenate([np.fromfile(f, dtype=np.uint8) for f in masks]))


def test_prepared_chat_folder_holds_each_conversation_and_its_mask(tmp_path):
    import sentencepiece as spm

    records = make_conversations(60)
    prepared = prepare_data(tmp_path / "out", chat_settings(write_jsonl(tmp_path / "c.jsonl", records)),
                            show_progress=False)
    assert prepared.format == "chat" and len(prepared.train_mask_files) == len(prepared.train_files)
    sp = spm.SentencePieceProcessor(model_file=str(prepared.tokenizer_path))
    # Decoded again, split at EOS: each conversation's PLAIN text, and its trained tokens are exactly the
    # assistant's content plus <|end|>, turn after turn.
    found = []
    for split in ("train", "val"):
        tokens, mask = read_split(prepared, split)
        ends = np.flatnonzero(tokens == sp.eos_id())
        assert ends[-1] == len(tokens) - 1 and not mask[ends].any()  # separators are never trained on
        for start, end in zip(np.r_[0, ends[:-1] + 1], ends, strict=True):
            ids, trained = tokens[start:end].tolist(), mask[start:end]
            found.append((sp.decode(ids), sp.decode([t for t, m in zip(ids, trained, strict=True) if m])))
    want = []
    for record in records:
        messages = conversation(record, ChatFields())
        want.append((plain_text(messages), "".join(m["content"] + PLAIN_END for m in messages
                                                   if m["role"] == "assistant")))
    assert sorted(found) == sorted(want)
    meta = json.loads((prepared.root / "meta.json").read_text())
    assert meta["format"] == "chat" and meta["num_trained_tokens"] == sum(
        int(read_split(prepared, s)[1].sum()) for s in ("train", "val"))


@pytest.mark.slow
def test_chat_preparation_does_not_depend_on_the_worker_count(tmp_path, monkeypatch):
    monkeypatch.setattr("data.prepare.CHUNK_BYTES", 2048)  # many work units, several shards
    path = write_jsonl(tmp_path / "c.jsonl", make_conversations(300, seed=1))
    outputs = []
    for num_workers in (0, 2):
        prepared = prepare_data(tmp_path / f"w{num_workers}", chat_settings(path, num_workers=num_workers,
                                                                            shard_tokens=3000), show_progress=False)
        files = sorted(p.name for p in prepared.root.iterdir() if p.suffix in (".bin", ".mask"))
        outputs.append({name: (prepared.root / name).read_bytes() for name in files})
    assert len([n for n in outputs[0] if n.endswith(".mask")]) >= 4
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_hf_template_preparation(tmp_path):
    tok = word_tokenizer(TEMPLATE_INCREMENTAL)
    tok.save_pretrained(tmp_path / "hf")
    records = make_conversations(40, seed=2)
    path = write_jsonl(tmp_path / "c.jsonl", records)
    prepared = prepare_data(tmp_path / "out", chat_settings(path, **hf_tokenizer(tmp_path)),
                            show_progress=False)
    tokens, mask = read_split(prepared, "train")
    eos = tok.eos_token_id
    # The training conversations (the documented split rule: a keyed hash of the conversation's canonical text),
    # rendered and masked as in test_tokenizer_template_masks_..., each followed by an untrained EOS, in order.
    want_tokens, want_mask = [], []
    for record in records:
        messages = conversation(record, ChatFields())
        if held_out(canonical_text(messages), seed=7, val_fraction=0.1):
            continue
        words, words_mask = expected_words(messages)
        want_tokens += tok.convert_tokens_to_ids(words) + [eos]
        want_mask += words_mask + [0]
    assert tokens.tolist() == want_tokens and mask.tolist() == want_mask


def test_document_masking_refuses_conversations_that_hold_the_eos(tmp_path):
    """A template that ends each turn with the EOS (as some instruction models' do): masking at every EOS would
    cut the conversations apart, so a run with data.document_masking refuses that folder in one line."""
    from fsdp_utils.train.run_data import check_format

    tok = word_tokenizer(TEMPLATE_INCREMENTAL.replace("<eot>", "<eos>"))
    tok.save_pretrained(tmp_path / "hf")
    path = write_jsonl(tmp_path / "c.jsonl", make_conversations(12, seed=3))
    prepared = prepare_data(tmp_path / "out", chat_settings(path, **hf_tokenizer(tmp_path)),
                            show_progress=False)
    assert check_format(prepared, "chat", document_masking=False) is prepared
    with pytest.raises(DataError, match=r"conversations in .* hold the tokenizer's EOS inside them") as err:
        check_format(prepared, "chat", document_masking=True)
    assert "\n" not in str(err.value)

def test_bad_records_stop_with_the_line_or_are_skipped(tmp_path):
    records = make_conversations(20) + [{"messages": [{"role": "user", "content": "alpha"}]}, "not json"]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    with pytest.raises(DataError, match=r"c.jsonl line 21: no assistant message.*on_bad_record=skip"):
        prepare_data(tmp_path / "a", chat_settings(path), show_progress=False)
    prepared = prepare_data(tmp_path / "b", chat_settings(path, on_bad_record="skip"), show_progress=False)
    meta = json.loads((prepared.root / "meta.json").read_text())
    assert meta["num_skipped_records"] == 2 and meta["num_train_documents"] + meta["num_val_documents"] == 20
    txt = tmp_path / "c.txt"
    txt.write_text("alpha")
    with pytest.raises(DataError, match="data.format=chat reads .jsonl"):
        prepare_data(tmp_path / "c", chat_settings(txt), show_progress=False)


# Templates that never finish: 10**10 empty loop turns (the attack), and the same with output inside a {% generation %}
# block (the other way a template is rendered, and text without bound).
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + TEMPLATE_INCREMENTAL
ENDLESS_GENERATION = TEMPLATE_GENERATION.replace(
    "{% generation %}", "{% generation %}{% for i in range(100000) %}{% for j in range(100000) %}{{ m.content }}"
                        "{% endfor %}{% endfor %}")


@pytest.mark.parametrize("template", [ENDLESS, ENDLESS_GENERATION], ids=["loops", "generation"])
def test_a_template_that_never_ends_is_one_line_naming_it(tmp_path, monkeypatch, template):
    import time

    monkeypatch.setattr("data.chat.RENDER_SECONDS", 0.5)  # instead of 10: the bound, not its size, is tested
    word_tokenizer(template).save_pretrained(tmp_path / "hf")
    path = write_jsonl(tmp_path / "c.jsonl", make_conversations(5))
    start = time.process_time()
    with pytest.raises(DataError) as err, failing_after(120):
        prepare_data(tmp_path / "out", chat_settings(path, **hf_tokenizer(tmp_path), on_bad_record="skip"),
                     show_progress=False)
    # Stopped at the first conversation (a template error is the corpus's, not a record to skip), in about 0.5 s of
    # its rendering's CPU time (preparation's own start, tokenizer training included, takes a few more).
    assert time.process_time() - start < 30
    assert re.fullmatch(rf"the chat template of the tokenizer in {tmp_path / 'out' / 'hf_tokenizer'} took more than "
                        rf"0.5 s of CPU time to render one conversation \(a loop without end\?\): fix the template, or "
                        rf"set data.chat_template=plain \(met at {path} line \d\)", str(err.value)), err.value
    assert not (tmp_path / "out" / "meta.json").exists()


def test_the_render_bound_leaves_the_caller_as_it_was():
    """The timer is off and the signal handler back once a render ends, whether it finished or ran out of time."""
    import signal

    from data.chat import TemplateUnusable, render_template

    before = signal.getsignal(signal.SIGVTALRM)
    messages = conversation(make_conversations(2)[1], ChatFields())
    assert render_template(word_tokenizer(TEMPLATE_INCREMENTAL), messages)[0]
    assert signal.getitimer(signal.ITIMER_VIRTUAL) == (0.0, 0.0) and signal.getsignal(signal.SIGVTALRM) is before
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("data.chat.RENDER_SECONDS", 0.2)
        with pytest.raises(TemplateUnusable, match="took more than 0.2 s of CPU time"):
            render_template(word_tokenizer(ENDLESS), messages)
    assert signal.getitimer(signal.ITIMER_VIRTUAL) == (0.0, 0.0) and signal.getsignal(signal.SIGVTALRM) is before


def test_tokenizer_without_a_chat_template_is_one_line(tmp_path):
    tok = word_tokenizer(TEMPLATE_INCREMENTAL)
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "hf")
    path = write_jsonl(tmp_path / "c.jsonl", make_conversations(5))
    with pytest.raises(DataError, match="has no chat template; set data.chat_template=plain"):
        prepare_data(tmp_path / "out", chat_settings(path, **hf_tokenizer(tmp_path)), show_progress=False)
    # Ours works with any tokenizer.
    prepared = prepare_data(tmp_path / "out", chat_settings(path, **hf_tokenizer(tmp_path),
                                                            chat_template="plain"), show_progress=False)
    assert prepared.format == "chat"


def test_loader_targets_are_ignored_where_the_mask_is_zero(tmp_path):
    prepared = prepare_data(tmp_path / "out", chat_settings(write_jsonl(tmp_path / "c.jsonl", make_conversations(80))),
                            show_progress=False)
    tokens, mask = read_split(prepared, "train")
    seq_len = 16
    dataset = TokenDataset(prepared.train_files, dtype=prepared.dtype, seq_len=seq_len, seed=3,
                           mask_paths=prepared.train_mask_files)
    x, y = dataset.batch(5, 4)
    for row, index in enumerate(range(5, 9)):
        start = dataset.window_start(index)
        want = tokens[start + 1 : start + seq_len + 1].astype(np.int64)
        want[mask[start + 1 : start + seq_len + 1] == 0] = IGNORE_INDEX
        assert x[row].tolist() == tokens[start : start + seq_len].tolist()
        assert y[row].tolist() == want.tolist()
    assert (y == IGNORE_INDEX).any() and (y != IGNORE_INDEX).any()


def test_training_on_a_folder_of_the_other_format_is_one_line(tmp_path):
    from fsdp_utils.train.run_data import check_format

    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join(WORDS[i:] + WORDS[:i])}) + "\n" for i in range(10)))
    folder = tmp_path / "text"
    prepared = prepare_data(folder, PrepareSettings(files=(str(text),), vocab_size=300, num_workers=0),
                            show_progress=False)
    line = (f"data.format=chat: {folder} holds text data (prepared with data.format=text), not chat: set "
            f"data.format=text, or prepare the corpus with data.format=chat into another folder")
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "config/train_tiny_fsdp.yaml", [f"--data.dataset_dir={folder}", "--data.format=chat"])
    assert err.value.problems == [line]
    with pytest.raises(DataError) as raised:  # the same line when the job finds it (a folder prepared meanwhile)
        check_format(load_prepared(folder), "chat")
    assert str(raised.value) == line
    assert check_format(prepared, "text") is prepared


# ---- the loss ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_tokens", [0, 7])
def test_loss_counts_only_the_trained_targets(chunk_tokens):
    torch.manual_seed(0)
    h = torch.randn(40, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    targets = torch.randint(0, 11, (40,))
    targets[torch.rand(40) < 0.6] = IGNORE_INDEX
    kept = targets != IGNORE_INDEX
    # Reference: the plain mean cross-entropy of the kept rows alone.
    ref = F.cross_entropy(h[kept] @ w.T, targets[kept])
    ref_grads = torch.autograd.grad(ref, (h, w))
    loss = chunked_cross_entropy(h, w, targets, chunk_tokens=chunk_tokens)
    grads = torch.autograd.grad(loss, (h, w))
    torch.testing.assert_close(loss, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)
    summed = chunked_cross_entropy(h, w, targets, chunk_tokens=chunk_tokens, reduction="sum")
    torch.testing.assert_close(summed, ref * kept.sum())
    # A window whose targets are all ignored: 0 and zero gradients, never NaN.
    none = chunked_cross_entropy(h, w, torch.full_like(targets, IGNORE_INDEX), chunk_tokens=chunk_tokens)
    assert none.item() == 0.0
    assert all(g.abs().sum() == 0 for g in torch.autograd.grad(none, (h, w)))


def _global_batch(world_size: int, grad_accum: int, seq_len: int, vocab: int) -> list[tuple[torch.Tensor, ...]]:
    """[rank][micro] (x, y) with very different numbers of trained targets per micro-batch, one with none."""
    g = torch.Generator().manual_seed(11)
    batches = []
    for rank in range(world_size):
        for micro in range(grad_accum):
            x = torch.randint(0, vocab, (2, seq_len), generator=g)
            y = torch.randint(0, vocab, (2, seq_len), generator=g)
            keep = torch.rand(2, seq_len, generator=g) < [0.9, 0.1, 0.5, 0.0][(rank * grad_accum + micro) % 4]
            batches.append((x, torch.where(keep, y, IGNORE_INDEX)))
    return batches


def _rank_step(rank: int, world_size: int, grad_accum: int) -> dict:
    """One rank's forward_backward under FSDP2, and the reference on rank 0: the whole global batch at once."""
    from torch.distributed.fsdp import fully_shard

    from config import FSDPConfig
    from fsdp_utils.parallel.fsdp import fsdp_adapter
    from fsdp_utils.train.step import forward_backward
    from model import ModelConfig
    from model.transformer import Transformer
    from tests.distributed_harness import cpu_env

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(seed=1)
    reference = Transformer(cfg)
    reference.load_state_dict(model.state_dict())
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    batches = _global_batch(world_size, grad_accum, 16, 50)
    mine = iter(batches[rank * grad_accum : (rank + 1) * grad_accum])
    fsdp = fsdp_adapter(FSDPConfig(version=2, grad_sync="last_micro_batch"), cpu_env(rank, world_size))
    loss = forward_backward(model, mine, None, fsdp=fsdp, grad_accum=grad_accum, world_size=world_size,
                            masked_targets=True)
    torch.distributed.all_reduce(loss)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    out = {"loss": loss.item() / world_size}
    if rank == 0:
        # The global batch's summed loss over its trained targets, divided by their number.
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        ref = reference(x, y, loss_reduction="sum") / (y != IGNORE_INDEX).sum()
        ref.backward()
        out["ref_loss"] = ref.item()
        out["max_grad_error"] = max((grads[n] - p.grad).abs().max().item() / p.grad.abs().max().item()
                                    for n, p in reference.named_parameters())
    return out


@pytest.mark.slow  # spawns two ranks
def test_masked_loss_is_normalised_over_the_whole_global_batch():
    results = run_ranks(_rank_step, world_size=2, grad_accum=2)
    assert math.isclose(results[0]["loss"], results[0]["ref_loss"], rel_tol=1e-5)
    assert results[0]["loss"] == results[1]["loss"]
    assert results[0]["max_grad_error"] < 1e-5


# ---- the example config, end to end -----------------------------------------------------------------

FINETUNE_CONFIG = ROOT / "config/finetune_chat_hf.yaml"


def save_tiny_llama(path: Path, template: str) -> None:
    """A tiny random Llama and the word-level tokenizer with its chat template, in one model folder."""
    tok = word_tokenizer(template)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def test_finetune_config_loads(tmp_path):
    (tmp_path / "hf").mkdir()  # the config's checks need the folder to exist; the launch reads it
    cfg = load_config(FINETUNE_CONFIG, [f"--model.hf_path={tmp_path / 'hf'}"])
    assert (cfg.model.type, cfg.data.format, cfg.data.tokenizer) == ("hf", "chat", "hf")


@pytest.mark.slow  # a two-rank training job
def test_finetune_chat_hf_end_to_end(tmp_path):
    from data.mixture import open_datasets
    from tests.helpers import losses, read_metrics, run_job

    hf, dataset_dir, out = tmp_path / "hf", tmp_path / "data", tmp_path / "out"
    save_tiny_llama(hf, TEMPLATE_INCREMENTAL)
    data = write_jsonl(tmp_path / "chat.jsonl", make_conversations(300, seed=5))
    overrides = [f"--model.hf_path={hf}", f"--data.files=[{data}]", f"--data.dataset_dir={dataset_dir}",
                 f"--run.output_dir={out}", "--run.device=cpu", "--data.seq_len=32", "--train.global_batch_size=8",
                 "--train.micro_batch_size=2", "--train.max_steps=8", "--train.lr=3e-3", "--train.warmup_steps=1",
                 "--train.eval_interval=4", "--train.eval_samples=4", "--logging.interval=1",
                 "--logging.trackers=[]"]
    proc = run_job([str(ROOT / "train_fsdp.py"), str(FINETUNE_CONFIG), *overrides], nproc=2, env=job_env(),
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logged = losses(out)
    assert sorted(logged) == list(range(1, 9)) and logged[8] < logged[1] - 0.2, logged
    assert (out / "fsdp_sharded_cpt8").is_dir()

    # Step 1's loss by hand: the untrained model's logits on the first global batch (samples 0..7, whatever the
    # ranks), cross-entropy over the assistant's targets only. Counting the prompt's targets too gives another loss.
    cfg = load_config(FINETUNE_CONFIG, overrides)
    train, _ = open_datasets([(load_prepared(dataset_dir), 1.0)], seq_len=32, seed=cfg.run.seed)
    x, y = train.batch(0, 8)
    lm = transformers.LlamaForCausalLM.from_pretrained(hf)
    with torch.no_grad():
        logits = lm(input_ids=x).logits.float()
    trained = y != IGNORE_INDEX
    by_hand = F.cross_entropy(logits[trained], y[trained]).item()
    assert 0 < trained.sum() < trained.numel()
    assert math.isclose(logged[1], by_hand, rel_tol=1e-5), (logged[1], by_hand)
    every_target = torch.stack([torch.from_numpy(train.window(i)[1:]) for i in range(8)])
    counting_all = F.cross_entropy(logits.flatten(0, 1), every_target.flatten()).item()
    # (a random model: every token costs about ln V, so the two differ little, yet far more than the 1e-5 above)
    assert abs(counting_all - logged[1]) > 2e-4 * logged[1], (counting_all, logged[1])
    val_rows = [row for row in read_metrics(out) if "val_loss" in row]
    assert [row["step"] for row in val_rows] == [4, 8] and all(math.isfinite(row["val_loss"]) for row in val_rows)


@pytest.mark.slow  # a training job
def test_generate_chat_samples_a_sentencepiece_chat_model(tmp_path, capsys):
    """A tiny model trained on chat data with a SentencePiece tokenizer (the PLAIN template): half the conversations
    answer "alpha beta gamma" with "omega sigma lambda", which 300 steps learn by heart. generate.py --chat renders
    the prompt as training did and stops at the end-of-turn marker: greedy, it gives that reply and nothing after."""
    from scripts import generate
    from tests.helpers import run_train

    fixed = {"prompt": "alpha beta gamma", "response": "omega sigma lambda"}
    records = [record if i % 2 else fixed for i, record in enumerate(make_conversations(200, seed=3))]
    data = write_jsonl(tmp_path / "chat.jsonl", records)
    run_train("--data.format=chat", "--data.vocab_size=300", "--train.max_steps=300", "--logging.interval=100",
              out_dir=tmp_path / "out", corpus=data, dataset_dir=tmp_path / "data", timeout=600)
    argv = [str(tmp_path / "out/fsdp_cpt300.pth"), "--chat", "--temperature", "0", "--device", "cpu",
            "--max_new_tokens", "30"]
    assert generate.main([*argv, "--prompt", "alpha beta gamma"]) == 0
    assert capsys.readouterr().out == "alpha beta gammaomega sigma lambda\n"
