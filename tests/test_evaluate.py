"""Downstream evaluation through lm-evaluation-harness: our LM's log-likelihoods, rolling log-likelihoods and
greedy generations equal ones computed by hand from the model's logits; task metrics follow from them; an HF
folder gives what lm_eval's own HFLM gives; two FSDP ranks give what one process gives; train.eval_tasks logs
the scores scripts/evaluate.py finds on the checkpoint. Every task is local (a .jsonl written by the test)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("sentencepiece")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data.tokenizer import train_tokenizer  # noqa: E402
from fsdp_utils.evaluation.downstream import flat_metrics, load_tasks, run_tasks, task_manager, task_problems  # noqa: E402
from fsdp_utils.evaluation.lm_eval_model import ModelLM, SentencePieceCodec  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from tests.distributed_harness import cpu_env, run_ranks  # noqa: E402
from tests.helpers import ROOT, job_env, random_model, read_metrics, run_job, run_train, write_corpus  # noqa: E402

CFG = ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
MAX_LEN = CFG.max_seq_len
TASKS = ["tiny_choice", "tiny_rolling", "tiny_gen"]
STOP = "e"  # a common letter, so that generations are cut at a stop string
CPU = torch.device("cpu")


# ---- the local tasks, the tokenizer and the model --------------------------------------------------------
def write_tasks(folder: Path, docs: list[str]) -> Path:
    """Three tasks over the corpus's documents, one per request type: which 12 characters follow 30 of a
    document (multiple choice), the perplexity of whole documents (rolling), and the greedy continuation of
    a document's start (generation), each reading a .jsonl in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    choice = []
    for i in range(8):
        options = [docs[(i + k) % len(docs)][30:42] for k in range(3)]
        order = [(k + i) % 3 for k in range(3)]  # the right answer moves around
        choice.append({"context": docs[i][:30], "choices": [options[k] for k in order], "answer": order.index(0)})
    rows = {"tiny_choice": choice,
            "tiny_rolling": [{"text": docs[0][:20]}, {"text": docs[1][:400]}, {"text": docs[2][:120]}],
            "tiny_gen": [{"context": docs[i][:15 + 4 * i], "target": docs[i][15 + 4 * i:30]} for i in range(5)]}
    specs = {
        "tiny_choice": 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
                       'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n'
                       '  - metric: acc_norm\n',
        "tiny_rolling": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                        'metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n',
        "tiny_gen": f'output_type: generate_until\ndoc_to_text: "{{{{context}}}}"\ndoc_to_target: "{{{{target}}}}"\n'
                    f'target_delimiter: ""\ngeneration_kwargs:\n  until: ["{STOP}"]\n  max_gen_toks: 10\n'
                    f'  do_sample: false\nmetric_list:\n  - metric: exact_match\n',
    }
    for name, spec in specs.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        (folder / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                             f"    test: {data}\ntest_split: test\n{spec}")
    return folder


def peaked_model(seed: int = 0) -> Transformer:
    """Peaked next-token distributions: padding, batching and sharding noise cannot flip a greedy choice."""
    return random_model(CFG, seed).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("evaluate")
    docs = write_corpus(root / "corpus.txt", num_docs=12).read_text().split("\n\n")
    train_tokenizer(docs, vocab_size=300, out_path=root / "tokenizer.model")
    return {"root": root, "docs": docs, "tasks": write_tasks(root / "tasks", docs),
            "codec": SentencePieceCodec(root / "tokenizer.model"), "model": peaked_model()}


def request(kind: str, *args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


# ---- references computed by hand from the logits (one unpadded sequence at a time) ------------------------
@torch.no_grad()
def token_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[j] | tokens[:j]) for j >= 1, in float64."""
    logits = model(torch.tensor([tokens[:-1]]))[0].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def loglikelihood_by_hand(model, codec, context: str, continuation: str) -> tuple[float, bool]:
    """Tokens as lm_eval splits a pair: a context's trailing whitespace moves to the continuation, whose tokens
    are those of context+continuation past the context's own (an empty context is EOS, the start of a
    document); cut on the left to MAX_LEN + 1."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    if context:
        whole, n_context = codec.encode(context + continuation), len(codec.encode(context))
    else:
        whole, n_context = [codec.eos_id] + codec.encode(continuation), 1
    n = len(whole) - n_context
    tokens = whole[-(MAX_LEN + 1):]
    logprob = token_logprobs(model, tokens)[-n:].sum().item()
    with torch.no_grad():
        greedy = model(torch.tensor([tokens[:-1]]))[0, -n:].argmax(-1).tolist() == tokens[-n:]
    return logprob, greedy


def rolling_by_hand(model, codec, text: str) -> float:
    """Every token predicted once, from as much context as MAX_LEN allows: tokens [a, a + MAX_LEN) read the
    MAX_LEN tokens before their end (fewer at the start, which begins with EOS)."""
    seq = [codec.eos_id] + codec.encode(text)
    total = 0.0
    for a in range(0, len(seq) - 1, MAX_LEN):
        end = min(a + MAX_LEN, len(seq) - 1)  # predict seq[a + 1 : end + 1]
        start = max(0, end - MAX_LEN)
        total += token_logprobs(model, seq[start:end + 1])[a - start:].sum().item()
    return total


def generate_by_hand(model, codec, context: str, max_new: int) -> str:
    """scripts/generate.py's greedy sampling (one sequence, no padding), cut at the first stop string."""
    from scripts.generate import sample

    new = sample(model, codec.encode(context), max_new_tokens=max_new, temperature=0, top_k=0,
                 generator=torch.Generator(), vocab_limit=codec.vocab_size, stop_id=codec.eos_id)
    return codec.decode(new).split(STOP)[0]


# ---- the LM against the references ----------------------------------------------------------------------------
def test_requests_equal_the_references_computed_from_the_logits(setup):
    model, codec, docs = setup["model"], setup["codec"], setup["docs"]
    lm = ModelLM(model, codec, device=CPU, batch_size=3, max_length=MAX_LEN)  # batches of mixed lengths: padding
    pairs = [(docs[0][:25], docs[0][25:40]), ("", docs[1][:20]), (docs[2] * 2, docs[2][:30]),  # a context cut
             (docs[3][:10], docs[3][10:12]), (docs[4][:40], docs[4][40:41])]
    got = lm.loglikelihood([request("loglikelihood", *pair) for pair in pairs])
    for (context, continuation), (logprob, greedy) in zip(pairs, got, strict=True):
        ref_logprob, ref_greedy = loglikelihood_by_hand(model, codec, context, continuation)
        assert logprob == pytest.approx(ref_logprob, abs=1e-4)
        assert greedy == ref_greedy
    # A text longer than MAX_LEN tokens takes several windows; a short one is one pass after EOS.
    texts = [docs[5][:600], docs[6][:30]]
    assert len(codec.encode(texts[0])) > 3 * MAX_LEN
    rolling = lm.loglikelihood_rolling([request("loglikelihood_rolling", text) for text in texts])
    assert rolling == pytest.approx([rolling_by_hand(model, codec, text) for text in texts], abs=1e-3)
    contexts = [docs[i][:8 + 5 * i] for i in range(5)]
    texts = lm.generate_until([request("generate_until", c, {"until": [STOP], "max_gen_toks": 12}) for c in contexts])
    assert texts == [generate_by_hand(model, codec, c, 12) for c in contexts]


@pytest.mark.slow  # runs three tasks and recomputes each by hand
def test_task_metrics_follow_from_the_references(setup):
    model, codec, tasks = setup["model"], setup["codec"], setup["tasks"]
    lm = ModelLM(model, codec, device=CPU, batch_size=4, max_length=MAX_LEN)
    metrics = flat_metrics(run_tasks(lm, load_tasks(task_manager(TASKS, [str(tasks)]), TASKS)))
    rows = {name: [json.loads(line) for line in (tasks / f"{name}.jsonl").read_text().splitlines()] for name in TASKS}
    # Accuracy: the choice of highest log-likelihood is the answer; acc_norm divides by the choice's characters.
    hits = hits_norm = 0
    for row in rows["tiny_choice"]:
        scores = [loglikelihood_by_hand(model, codec, row["context"], c)[0] for c in row["choices"]]
        hits += max(range(3), key=lambda k: scores[k]) == row["answer"]
        hits_norm += max(range(3), key=lambda k: scores[k] / len(row["choices"][k])) == row["answer"]
    assert metrics["eval/tiny_choice/acc"] == hits / len(rows["tiny_choice"])
    assert metrics["eval/tiny_choice/acc_norm"] == hits_norm / len(rows["tiny_choice"])
    # Word perplexity: exp(-(sum of log-likelihoods) / (sum of words)).
    texts = [row["text"] for row in rows["tiny_rolling"]]
    log_expected = -sum(rolling_by_hand(model, codec, t) for t in texts) / sum(len(re.split(r"\s+", t)) for t in texts)
    assert math.log(metrics["eval/tiny_rolling/word_perplexity"]) == pytest.approx(log_expected, abs=1e-5)
    hits = sum(generate_by_hand(model, codec, row["context"], 10) == row["target"] for row in rows["tiny_gen"])
    assert metrics["eval/tiny_gen/exact_match"] == hits / len(rows["tiny_gen"])
    assert lm.num_forward > 0


@pytest.mark.slow  # loads the 500 items of the shipped task
def test_shipped_task_runs_from_its_folder(setup):
    lm = ModelLM(setup["model"], setup["codec"], device=CPU, batch_size=8, max_length=MAX_LEN)
    folder = str(ROOT / "scripts/eval_tasks")
    names = ["python_next_line", "python_next_line_gen"]
    results = run_tasks(lm, load_tasks(task_manager(names, [folder]), names), limit=4)
    assert results["n-samples"]["python_next_line"] == {"original": 500, "effective": 4}
    assert 0 <= flat_metrics(results)["eval/python_next_line/acc"] <= 1


# ---- an HF folder: ours and lm_eval's HFLM ----------------------------------------------------------------------
def export_tiny(setup) -> tuple[Path, Path]:
    """A full checkpoint of the peaked model and its export as an HF folder (scripts/export_hf.py)."""
    from fsdp_utils.checkpoint import FORMAT_VERSION, TrainState
    from scripts import export_hf

    root = setup["root"]
    checkpoint, folder = root / "fsdp_cpt0.pth", root / "hf"
    if not folder.exists():
        train_state = {k: v for k, v in dataclasses.asdict(TrainState()).items() if k != "rng"}
        torch.save({"model": setup["model"].state_dict(), "optimizer": {"state": {}, "param_groups": []}, "rng": None,
                    "format_version": FORMAT_VERSION, "world_size": 1, "model_config": dataclasses.asdict(CFG),
                    "train_state": train_state}, checkpoint)
        export_hf.export(checkpoint, folder, tokenizer=root / "tokenizer.model")
    return checkpoint, folder


@pytest.mark.slow  # loads transformers' model twice and runs every task three times
def test_hf_folder_gives_what_lm_eval_s_hflm_and_our_checkpoint_give(setup):
    from lm_eval.models.huggingface import HFLM

    from scripts.evaluate import evaluate

    checkpoint, folder = export_tiny(setup)
    include = [str(setup["tasks"])]
    ours_hf = evaluate(folder, TASKS, include_path=include, batch_size=3, device="cpu", bootstrap_iters=0)
    # HFLM pads a batch on the left, which moves greedy generations by float noise: one sequence at a time.
    hflm = HFLM(pretrained=str(folder), batch_size=1, device="cpu")
    theirs = run_tasks(hflm, load_tasks(task_manager(TASKS, include), TASKS))
    assert ours_hf["evaluation"]["model"] == "hf"
    for key, value in flat_metrics(theirs).items():
        assert ours_hf["evaluation"]["metrics"][key] == pytest.approx(value, rel=1e-5), key
    # Our checkpoint with its SentencePiece tokenizer scores the same choices (the rolling task differs on
    # purpose: the HF tokenizer's texts start from BOS, ours from EOS as in training).
    ours = evaluate(checkpoint, ["tiny_choice", "tiny_gen"], include_path=include, batch_size=2, device="cpu",
                    tokenizer=setup["root"] / "tokenizer.model", bootstrap_iters=0)
    for key, value in ours["evaluation"]["metrics"].items():
        assert ours_hf["evaluation"]["metrics"][key] == pytest.approx(value, rel=1e-5), key


# ---- problems, found before anything runs ----------------------------------------------------------------------
@pytest.mark.slow
def test_unknown_tasks_missing_folders_and_a_missing_lm_eval_are_one_line_each(setup, monkeypatch, tmp_path):
    from fsdp_utils.evaluation import downstream

    # A name missing from the task folders sends the check to lm_eval's thousands of built-in tasks, whose
    # index takes seconds to build (a minute on a busy CPU): here the names meet the test's folder alone.
    local_only = downstream._manager.__wrapped__
    monkeypatch.setattr(downstream, "_manager", lambda path, with_defaults: local_only(path, False))
    include = [str(setup["tasks"])]
    assert task_problems(["tiny_choise"], include, where="train.eval_tasks") == [
        "train.eval_tasks: unknown lm-eval task 'tiny_choise' (did you mean 'tiny_choice'?)"]
    assert task_problems(["tiny_gen"], [str(tmp_path / "nowhere")], where="--tasks") == [
        f"--tasks: task folder not found: {tmp_path / 'nowhere'}"]
    assert task_problems([str(setup["tasks"] / "tiny_gen.yaml")], [], where="--tasks") == []  # a task file
    from config import ConfigError, TrainConfig, load_config

    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "config/train_tiny_fsdp.yaml", ["--train.eval_tasks=[tiny_gen]", "--train.eval_interval=0",
                                                          "--train.eval_tasks_limit=-1"])
    assert err.value.problems == [
        "train.eval_tasks_limit must be 0 (all documents) or positive, got -1",
        "train.eval_tasks run at every train.eval_interval, which is 0 (off); set train.eval_interval"]
    # The launch's checks (train_fsdp.py runs them) know the names before any process group starts.
    from fsdp_utils.distributed import read_torchrun_env
    from fsdp_utils.train.launch_checks import launch_checks

    cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml", ["--train.eval_tasks=[tiny_gen,nonesuch_task]",
                                                            f"--train.eval_tasks_path=[{include[0]}]",
                                                            f"--run.output_dir={tmp_path / 'run'}", "--run.device=cpu"])
    problems = launch_checks(cfg, read_torchrun_env(), None)
    assert [p for p in problems if "eval_tasks" in p] == [
        "train.eval_tasks: unknown lm-eval task 'nonesuch_task' (a task, group or tag name, or a task .yaml file)"]
    # A task whose data cannot be read stops the training at its setup, before step 1, in one line.
    from fsdp_utils.evaluation.downstream import DownstreamError, DownstreamEvaluator

    broken = tmp_path / "broken"
    broken.mkdir()
    spec = (setup["tasks"] / "tiny_gen.yaml").read_text().replace("tiny_gen", "tiny_broken")
    (broken / "tiny_broken.yaml").write_text(spec.replace(str(setup["tasks"]), str(tmp_path / "gone")))
    with pytest.raises(DownstreamError, match=r"^cannot load the lm-eval task\(s\) tiny_broken: \w+"):
        DownstreamEvaluator(TrainConfig(eval_tasks=["tiny_broken"], eval_tasks_path=[str(broken)], eval_tasks_limit=0),
                            tokenizer_kind="sentencepiece", tokenizer_path=setup["root"] / "tokenizer.model",
                            max_length=MAX_LEN, env=cpu_env(0, 1))
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now fails, as without the package
    assert task_problems(["tiny_gen"], include, where="train.eval_tasks") == [
        "train.eval_tasks needs the lm-eval package (EleutherAI's lm-evaluation-harness): pip install lm-eval"]


# ---- several ranks -------------------------------------------------------------------------------------------
def evaluate_sharded(rank: int, world_size: int, *, tasks: str, tokenizer: str) -> dict:
    """On each rank: the peaked model sharded by FSDP1, then by FSDP2, evaluated on every task."""
    from config import FSDPConfig
    from fsdp_utils.parallel.fsdp import fsdp_adapter
    from fsdp_utils.parallel.parallelize import resolve_precision
    from model import DecoderBlock
    from tests.helpers import parallelize

    env = cpu_env(rank, world_size)
    out = {}
    for version in (1, 2):
        model = parallelize(peaked_model(), fsdp=fsdp_adapter(FSDPConfig(version=version), env),
                            block_classes={DecoderBlock}, precision=resolve_precision("fp32", "fp32", CPU),
                            compile=False)
        lm = ModelLM(model, SentencePieceCodec(tokenizer), device=CPU, batch_size=2, max_length=MAX_LEN)
        results = run_tasks(lm, load_tasks(task_manager(TASKS, [tasks]), TASKS))
        out[version] = {"metrics": flat_metrics(results), "num_forward": lm.num_forward}
    return out


@pytest.mark.slow  # spawns two gloo ranks
def test_two_sharded_ranks_give_what_one_process_gives(setup):
    lm = ModelLM(setup["model"], setup["codec"], device=CPU, batch_size=2, max_length=MAX_LEN)
    single = flat_metrics(run_tasks(lm, load_tasks(task_manager(TASKS, [str(setup["tasks"])]), TASKS)))
    ranks = run_ranks(evaluate_sharded, world_size=2, timeout_s=300, tasks=str(setup["tasks"]),
                      tokenizer=str(setup["root"] / "tokenizer.model"))
    for version in (1, 2):
        for rank in ranks:
            assert rank[version]["metrics"].keys() == single.keys()
            for key, value in single.items():
                assert rank[version]["metrics"][key] == pytest.approx(value, rel=1e-6), (version, key)
        # Every forward pass of a sharded model is a collective: both ranks ran as many, each about half as
        # many as one process (the batches are split; a rank without one runs a one-row pass).
        counts = [rank[version]["num_forward"] for rank in ranks]
        assert counts[0] == counts[1] < lm.num_forward


# ---- in training, and the script on the checkpoint it saved ------------------------------------------------
@pytest.mark.slow  # a 2-rank training job, then scripts/evaluate.py on 2 ranks
def test_training_logs_the_scores_that_evaluate_py_finds_on_its_checkpoint(tmp_path, corpus, dataset_dir):
    tasks = write_tasks(tmp_path / "tasks", corpus.read_text().split("\n\n"))
    run_dir = tmp_path / "run"
    run_train("--train.max_steps=4", "--train.eval_interval=2", f"--train.eval_tasks=[{','.join(TASKS)}]",
              f"--train.eval_tasks_path=[{tasks}]", "--checkpoint.format=sharded", nproc=2, out_dir=run_dir,
              corpus=corpus, dataset_dir=dataset_dir)
    evals = {row["step"]: row for row in read_metrics(run_dir) if "val_loss" in row}
    assert sorted(evals) == [2, 4]
    for row in evals.values():
        assert 0 < row["downstream_time_s"] <= row["eval_time_s"]
        assert 0 <= row["eval/tiny_choice/acc"] <= 1
    # The checkpoint saved at step 4 by 2 ranks, evaluated by 2 other ranks with the whole model each.
    out = tmp_path / "results.json"
    argv = [str(ROOT / "scripts/evaluate.py"), str(run_dir / "fsdp_sharded_cpt4"), "--tasks", ",".join(TASKS),
            "--include_path", str(tasks), "--device", "cpu", "--bootstrap_iters", "0", "--output", str(out)]
    env = job_env({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    proc = run_job(argv, nproc=2, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "|tiny_choice" in proc.stdout and "evaluated in" in proc.stdout
    scores = json.loads(out.read_text())["evaluation"]["metrics"]
    logged = {key: value for key, value in evals[4].items() if key.startswith("eval/")}
    assert logged.keys() == scores.keys()
    for key, value in scores.items():
        assert logged[key] == pytest.approx(value, rel=1e-5), key


# ---- --output ------------------------------------------------------------------------------------------------
def test_the_output_is_checked_before_evaluating_and_replaced_as_a_whole(tmp_path, monkeypatch, capsys):
    """--output on a FIFO blocked once the whole evaluation was done; onto a folder or into a missing one, the
    evaluation ran to its end and its results were lost. Each is now refused before anything is evaluated (the
    evaluation is replaced here by one that records its call), a link too (nothing is written through one); a file
    there is replaced by the results, written beside it first."""
    from scripts import evaluate
    from tests.helpers import failing_after

    ran: list[str] = []
    monkeypatch.setattr(evaluate, "task_problems", lambda *args, **kwargs: [])  # no task index to build
    monkeypatch.setattr(evaluate, "evaluate", lambda checkpoint, *args, **kwargs: ran.append(checkpoint) or
                        {"results": {"tiny_gen": {"exact_match": 0.25}}})
    monkeypatch.setattr(evaluate, "report", lambda results: "the table")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    (tmp_path / "users.json").write_text("the user's own")
    (tmp_path / "link.json").symlink_to(tmp_path / "users.json")
    for output, why in ((tmp_path / "fifo", "a FIFO, not a file to write the results to"),
                        (tmp_path / "folder", "a folder, not a file to write the results to"),
                        (tmp_path / "link.json", "a symbolic link, not a file to write the results to"),
                        (tmp_path / "missing/results.json", f"the folder {tmp_path / 'missing'} does not exist")):
        with failing_after(30):  # the write to a FIFO blocks for ever: fail instead
            assert evaluate.main(["ckpt", "--tasks", "tiny_gen", "--output", str(output)]) == 2
        assert capsys.readouterr().err == f"error: --output {output}: {why}\n"
    assert ran == [] and (tmp_path / "users.json").read_text() == "the user's own"
    (tmp_path / "results.json").write_text("earlier results")
    assert evaluate.main(["ckpt", "--tasks", "tiny_gen", "--output", str(tmp_path / "results.json")]) == 0
    assert json.loads((tmp_path / "results.json").read_text()) == {"results": {"tiny_gen": {"exact_match": 0.25}}}
    assert ran == [Path("ckpt")] and sorted(p.name for p in tmp_path.iterdir()) == [
        "fifo", "folder", "link.json", "results.json", "users.json"]
