"""benchmarks/compare_torchtitan.py: the peer's arguments derived from our presets, the parsing of both runs' results,
the table, and one whole invocation with the two runs played by a small fake script."""
from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from benchmarks import benchmark, compare_torchtitan as ct
from config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
# The peer as the docs' command names it, beside the checkout; its tests skip where it is not there.
PEER_SCRIPT = ROOT.parent / "shared" / "peers" / "torchtitan_peer.py"

# A result line as torchtitan_peer.py prints it (its f-string filled in), among the lines around it.
PEER_OUTPUT = [
    "tt_peer: warmup (2 steps) took 95.3 s",
    "tt_peer: 5 timed steps in 5.64 s, 1128 ms/step, loss 11.931, grad_norm 2.112, peak reserved 84.0 GiB, "
    "post-optimizer hook calls 7, weights with precomputed fp8 scale 224",
    "TT torchtitan-0.2.2 params=8030M L32 d4096 kv8 seq2048 mbs8 acselective_op compile=1 fp8=tensorwise+ag+pre "
    "world2: 13544 tok/s/GPU, MFU 41.0% (6*N_nonembed + 12*L*d*seq, peak 989 TFLOP/s), peak mem 81.1 GiB",
]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def torchtitan_width(args: list[str]) -> int:
    """The FFN width the peer builds from these arguments, by torchtitan's FeedForward rule as the peer's docstring
    states it (h = int(2*4*dim/3); with a multiplier h = int(m*h); rounded up to multiple_of), the multiplier read
    as the peer's argparse reads it. Written here from that rule, not taken from the script under test."""
    dim, multiple_of = int(flag(args, "--dim")), int(flag(args, "--multiple_of") or 256)
    hidden = int(2 * 4 * dim / 3)
    multiplier = flag(args, "--ffn_dim_multiplier")
    if multiplier is not None:
        hidden = int(float(multiplier) * hidden)
    return multiple_of * -(-hidden // multiple_of)


def test_width_rule_gives_the_peers_documented_widths():
    # The peer's docstring: dim 2048 -> 5632 with the default multiple_of 256; dim 4096 -> 14336 with 1.3 / 1024.
    assert torchtitan_width(["--dim", "2048"]) == 5632
    assert torchtitan_width(["--dim", "4096", "--ffn_dim_multiplier", "1.3", "--multiple_of", "1024"]) == 14336


PRESETS = [
    # (config, overrides, --peer_ac, --peer_mbs, what the peer must get)
    ("train1B_fsdp.yaml", [], "none", 16,
     {"--dim": "2048", "--layers": "24", "--heads": "16", "--kv_heads": "16", "--vocab": "32000", "--seq": "2048",
      "--ffn": "5632", "--mbs": "16", "--ac": "none", "--rope_theta": "10000.0", "--norm_eps": "1e-05"}),
    ("train8B_fsdp.yaml", ["--model.vocab_size=128256"], "selective_op", 8,
     {"--dim": "4096", "--layers": "32", "--heads": "32", "--kv_heads": "8", "--vocab": "128256", "--seq": "2048",
      "--ffn": "14336", "--mbs": "8", "--ac": "selective_op", "--rope_theta": "500000.0"}),
    ("train300M_fsdp.yaml", ["--train.micro_batch_size=4"], None, None,
     {"--dim": "1024", "--layers": "24", "--heads": "16", "--kv_heads": "16", "--vocab": "32000", "--ffn": "2816",
      "--mbs": "4", "--ac": "none"}),
]


@pytest.mark.parametrize(("name", "overrides", "peer_ac", "peer_mbs", "expected"), PRESETS,
                         ids=[p[0] for p in PRESETS])
def test_presets_give_the_peer_our_model(name, overrides, peer_ac, peer_mbs, expected):
    cfg = load_config(ROOT / "config" / name, overrides)
    args = ct.peer_arguments(cfg, peer_ac=peer_ac, peer_mbs=peer_mbs, steps=5, warmup=2)
    assert {key: flag(args, key) for key in expected} == expected
    # torchtitan builds our FFN width from the multiplier and rounding passed (and --ffn, which the peer asserts)
    assert torchtitan_width(args) == cfg.model.hidden_dim == int(flag(args, "--ffn"))
    assert "--compile" in args and (flag(args, "--steps"), flag(args, "--warmup")) == ("5", "2")
    assert ("--float8" in args) == (name == "train8B_fsdp.yaml")


def peer_parser(path: Path):
    """The peer script's own argument parser: its text up to parse_args() (plain argparse), run here."""
    text = path.read_text()
    namespace: dict = {}
    exec(compile(text[:text.index("a = p.parse_args()")], str(path), "exec"), namespace)
    return namespace["p"]


@pytest.mark.parametrize(("name", "overrides", "peer_ac", "peer_mbs", "expected"), PRESETS,
                         ids=[p[0] for p in PRESETS])
def test_peer_script_accepts_the_arguments(name, overrides, peer_ac, peer_mbs, expected):
    if not PEER_SCRIPT.is_file():
        pytest.skip(f"no peer script at {PEER_SCRIPT}")
    cfg = load_config(ROOT / "config" / name, overrides)
    parsed = peer_parser(PEER_SCRIPT).parse_args(ct.peer_arguments(cfg, peer_ac=peer_ac, peer_mbs=peer_mbs,
                                                                   steps=5, warmup=2))
    assert (parsed.dim, parsed.ffn, parsed.mbs) == (cfg.model.dim, cfg.model.hidden_dim, int(expected["--mbs"]))


def test_the_peer_accumulates_to_our_global_batch_when_asked():
    cfg = load_config(ROOT / "config" / "train8B_fsdp.yaml", ["--model.vocab_size=128256"])  # global batch 64
    own = ct.peer_arguments(cfg, peer_ac="selective_op", peer_mbs=16, steps=5, warmup=2, nproc=2)
    ours = ct.peer_arguments(cfg, peer_ac="selective_op", peer_mbs=16, steps=5, warmup=2, nproc=2,
                             same_global_batch=True)
    assert "--grad_accum" not in own and flag(ours, "--grad_accum") == "2"  # 16 x 2 GPUs x 2 = 64
    assert "--grad_accum" not in ct.peer_arguments(cfg, peer_ac="none", peer_mbs=32, steps=5, warmup=2, nproc=2,
                                                   same_global_batch=True)  # 32 x 2 is 64 already
    assert ct.describe_case("train8B_fsdp.yaml", cfg, ours, 2).endswith("mbs auto (peer 16 x 2), 2 GPUs")
    if PEER_SCRIPT.is_file():
        assert peer_parser(PEER_SCRIPT).parse_args(ours).grad_accum == 2
    with pytest.raises(ConfigError) as err:
        ct.peer_arguments(cfg, peer_ac="none", peer_mbs=24, steps=5, warmup=2, nproc=2, same_global_batch=True)
    assert err.value.problems == ["--peer_global_batch ours: train.global_batch_size=64 is not a multiple of the "
                                  "peer's micro-batch 24 x 2 GPU(s)"]


@pytest.mark.parametrize("dim", [256, 1000, 2048, 4096, 8192])
@pytest.mark.parametrize("hidden", [688, 2816, 5000, 11008, 13824, 14336, 28672, 53248, 4097])
def test_ffn_arguments_reproduce_any_width(dim, hidden):
    multiplier, multiple_of = ct.ffn_arguments(dim, hidden)
    args = ["--dim", str(dim), "--multiple_of", str(multiple_of)]
    if multiplier is not None:
        args += ["--ffn_dim_multiplier", repr(multiplier)]
    assert torchtitan_width(args) == hidden


def test_ffn_width_without_arguments_is_one_error():
    with pytest.raises(ConfigError) as err:
        ct.ffn_arguments(4096, 0)
    assert err.value.problems == ["model FFN width 0 (dim 4096): no --ffn_dim_multiplier / --multiple_of gives it in "
                                  "torchtitan's FeedForward"]


def config_1b(*overrides: str):
    return load_config(ROOT / "config" / "train1B_fsdp.yaml", ["--train.micro_batch_size=8", *overrides])


def test_float8_recipes_map_to_the_peers_flags():
    tensorwise = ct.peer_float8(config_1b("--fsdp.version=2", "--train.float8=tensorwise"))
    assert tensorwise == ["--float8", "--float8_recipe", "tensorwise", "--float8_fsdp_all_gather",
                          "--float8_precompute_scale"]
    rowwise = ct.peer_float8(config_1b("--fsdp.version=2", "--train.float8=rowwise"))
    assert rowwise == ["--float8", "--float8_recipe", "rowwise"]
    assert ct.peer_float8(config_1b()) == []


@pytest.mark.parametrize(("ours", "peer"), [("none", "none"), ("full", "full"), ("selective_op", "selective_op"),
                                            ("selective", "selective_3")])
def test_activation_checkpointing_maps_by_name(ours, peer):
    cfg = config_1b(f"--fsdp.activation_checkpointing={ours}", "--fsdp.ac_every_n_layers=3")
    assert ct.peer_activation_checkpointing(cfg.fsdp, None) == peer


@pytest.mark.parametrize("ours", ["selective_op_lean", "selective_op_wide", "auto"])
def test_policies_without_a_peer_need_peer_ac(ours):
    cfg = config_1b(f"--fsdp.activation_checkpointing={ours}")
    with pytest.raises(ConfigError) as err:
        ct.peer_activation_checkpointing(cfg.fsdp, None)
    assert err.value.problems == [f"fsdp.activation_checkpointing={ours} has no torchtitan equivalent: pass "
                                  "--peer_ac (none, full, selective_op or selective_N)"]
    assert ct.peer_activation_checkpointing(cfg.fsdp, "selective_2") == "selective_2"
    with pytest.raises(ConfigError, match="--peer_ac selective_x: expected"):
        ct.peer_activation_checkpointing(cfg.fsdp, "selective_x")


def test_micro_batch_auto_needs_peer_mbs_and_tied_embeddings_are_refused():
    cfg = load_config(ROOT / "config" / "train1B_fsdp.yaml", ["--model.tie_embeddings=true"])
    with pytest.raises(ConfigError) as err:
        ct.peer_arguments(cfg, peer_ac="none", peer_mbs=None, steps=1, warmup=0)
    assert err.value.problems == [
        "model.tie_embeddings=true: torchtitan's Llama has no tied embeddings",
        "train.micro_batch_size=auto is searched by our run only: pass --peer_mbs (or a numeric "
        "--train.micro_batch_size=N for both)"]


def test_bad_arguments_end_with_error_lines(tmp_path, capsys):
    peer = tmp_path / "peer.py"
    peer.write_text("")
    code = ct.main([str(ROOT / "config" / "train8B_fsdp.yaml"), "--peer_script", str(peer), "--peer_mbs", "8",
                    "--launcher", sys.executable])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: fsdp.activation_checkpointing=auto has no torchtitan equivalent: pass --peer_ac (none, full, "
        "selective_op or selective_N)"]


def test_our_batch_that_does_not_split_over_the_gpus_is_refused_before_the_runs(tmp_path, capsys):
    peer = tmp_path / "peer.py"
    peer.write_text("")
    code = ct.main([str(ROOT / "config" / "train300M_fsdp.yaml"), "--nproc", "3", "--peer_script", str(peer),
                    "--train.micro_batch_size=4", "--launcher", f"{sys.executable} {tmp_path / 'never_run.py'}"])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: train.global_batch_size=64 is not divisible by train.micro_batch_size * world size = 4 * 3 = 12; "
        "pick a global batch that is a multiple of 12"]


def test_document_masking_is_switched_off_unless_given():
    assert ct.our_overrides(["--train.compile=false"]) == (["--train.compile=false", "--data.document_masking=false"],
                                                           True)
    assert ct.our_overrides(["--data.document_masking=true"]) == (["--data.document_masking=true"], False)


def test_peer_result_line_is_parsed():
    assert ct.parse_peer(PEER_OUTPUT) == {"tokens_per_sec_per_gpu": 13544.0, "mfu": pytest.approx(0.41),
                                          "peak_mem_gib": 81.1}
    assert ct.parse_peer(PEER_OUTPUT[:2]) is None


def test_our_result_is_read_from_benchmarks_own_json(tmp_path):
    # benchmark.py's own summary and --json writer: 4 x 2048 tokens in a median step of 0.5 s = 16,384 tok/s/GPU.
    cfg = load_config(ROOT / "config" / "train300M_fsdp.yaml", ["--model.vocab_size=32000"])
    out = tmp_path / "ours.jsonl"
    args = benchmark.build_parser().parse_args(["config/train300M_fsdp.yaml", "--json", str(out)])
    args.doc_len = 0
    row = benchmark.summarise("ours", [0.5, 0.4, 0.6], 12.5, (4, 1), cfg, 1e15)
    env = types.SimpleNamespace(device=torch.device("cpu"), world_size=2)
    benchmark.report_rounds([row], {"ours": [0.5]}, cfg, env, args, overrides=[], recipes=[])
    ours = ct.parse_ours(out.read_text())
    assert ours == {"tokens_per_sec_per_gpu": 16384.0, "mfu": row["mfu"], "peak_mem_gib": 12.5, "step_s": 0.5,
                    "micro_batch": 4, "grad_accum": 1, "device": "cpu"}


def test_failures_say_why():
    oom = ["[rank0]: Traceback (most recent call last):",
           "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total "
           "capacity of 79.19 GiB",
           "E1127 17:00:00 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: 1)",
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
           "============================================================"]
    assert ct.failure(1, oom) == "out of memory"
    crash = ["[rank1]: AssertionError: derived FFN hidden 14198 != --ffn 14336", *oom[2:]]
    assert ct.failure(1, crash) == "failed, exit 1, last line: AssertionError: derived FFN hidden 14198 != --ffn 14336"
    assert ct.failure(0, ["done"]) == "no result, exit 0, last line: done"


def test_table_reports_a_failed_side():
    ours = ct.summarise([{"tokens_per_sec_per_gpu": 12000.0, "mfu": 0.4, "peak_mem_gib": 80.5, "exit": 0}])
    peer = ct.summarise([{"error": "out of memory", "exit": 1}])
    lines, ratio, memory = ct.table("8B", ours, peer)
    assert lines[-1] == "| 8B | 12,000 | out of memory | - | 80.5 | - | - |"
    assert ratio is None and memory is None
    crashed = ct.summarise([{"error": "failed, exit 1, last line: ValueError: a | b", "exit": 1}])
    assert ct.table("8B", ours, crashed)[0][-1] == (
        "| 8B | 12,000 | failed, exit 1, last line: ValueError: a \\| b | - | 80.5 | - | - |")
    lines, ratio, memory = ct.table("8B", ours, ct.summarise([{"tokens_per_sec_per_gpu": 10000.0, "mfu": 0.35,
                                                               "peak_mem_gib": 81.0, "exit": 0}]))
    assert lines[-1] == "| 8B | 12,000 | 10,000 | 1.200 | 80.5 | 81.0 | -0.5 |"
    assert (ratio, memory) == (pytest.approx(1.2), pytest.approx(-0.5))


# Plays both runs: benchmark.py (writes its --json record) and the peer (prints a TT line, or runs out of memory
# when FAKE_PEER=oom). Ours' tokens/s are 1000, 1300, 1100 in successive rounds, its peak memory 20, 22, 21 GiB;
# each call is logged.
FAKE = textwrap.dedent("""
    import json, os, sys
    log = os.environ["FAKE_LOG"]
    with open(log, "a") as f:
        f.write(json.dumps({"argv": sys.argv[1:], "nvls": os.environ.get("NCCL_NVLS_ENABLE")}) + "\\n")
    if sys.argv[1].endswith("benchmark.py"):
        n = sum(1 for line in open(log) if "benchmark.py" in line)
        tps, mem = [(1000.0, 20.0), (1300.0, 22.0), (1100.0, 21.0)][n - 1]
        row = {"name": "ours", "micro_batch": 4, "grad_accum": 1, "step_s": 1.0, "tokens_per_sec_per_gpu": tps,
               "mfu": 0.3, "peak_mem_gib": mem}
        if os.environ.get("FAKE_OURS") == "garbled":
            row["tokens_per_sec_per_gpu"] = "1.2.3"
        with open(sys.argv[sys.argv.index("--json") + 1], "a") as f:
            f.write(json.dumps({"device": "Fake GPU", "rows": [row]}) + "\\n")
    elif os.environ.get("FAKE_PEER") == "oom":
        print("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        sys.exit(1)
    else:
        tps = {"zero": "0", "garbled": "1.2.3"}.get(os.environ.get("FAKE_PEER"), "1000")
        print("TT torchtitan-0.2.2 params=374M L24 d1024 kv16 seq2048 mbs4 acnone compile=1 world2: "
              f"{tps} tok/s/GPU, MFU 30.0% (6*N_nonembed + 12*L*d*seq, peak 989 TFLOP/s), peak mem 18.0 GiB")
""")


def run_fake(tmp_path, monkeypatch, *extra: str) -> tuple[int, list[dict], list[dict]]:
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE)
    peer = tmp_path / "peer.py"
    peer.write_text("")
    log, out = tmp_path / "calls.jsonl", tmp_path / "out.jsonl"
    log.unlink(missing_ok=True)
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    code = ct.main([str(ROOT / "config" / "train300M_fsdp.yaml"), "--nproc", "2", "--peer_script", str(peer),
                    "--launcher", f"{sys.executable} {fake}", "--train.micro_batch_size=4", "--steps", "2",
                    "--warmup", "1", "--json", str(out), *extra])
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return code, calls, [json.loads(line) for line in out.read_text().splitlines()]


def test_whole_comparison_with_fake_runs(tmp_path, monkeypatch, capsys):
    code, calls, records = run_fake(tmp_path, monkeypatch, "--rounds", "3")
    assert code == 0
    # alternating, ours first; the peer got our model, ours masking off and both the NVLS setting
    assert [Path(c["argv"][0]).name for c in calls] == ["benchmark.py", "peer.py"] * 3
    ours_argv, peer_argv = calls[0]["argv"], calls[1]["argv"]
    assert "--data.document_masking=false" in ours_argv and "--train.micro_batch_size=4" in ours_argv
    assert (flag(peer_argv, "--dim"), flag(peer_argv, "--ffn"), flag(peer_argv, "--mbs")) == ("1024", "2816", "4")
    assert all(c["nvls"] == "0" for c in calls)
    (record,) = records
    # ours: median of 1000, 1300, 1100 tok/s and the highest of 20, 22, 21 GiB; the peer 1000 tok/s and 18 GiB
    assert record["ratio"] == pytest.approx(1.1) and record["memory_diff_gib"] == pytest.approx(4.0)
    assert record["gpu"] == {"name": "Fake GPU", "count": 2}
    if (ROOT / ".git").exists():  # a checkout (an unpacked release has no commit to name)
        assert re.fullmatch(r"[0-9a-f]{40}(-modified)?", record["git_commit"])
    else:
        assert record["git_commit"] is None
    assert record["commands"]["peer"].endswith("--steps 2 --warmup 1")
    printed = capsys.readouterr().out
    assert ("| train300M_fsdp, bf16, AC none, mbs 4 x 8 (peer 4), 2 GPUs | 1,100 | 1,000 | 1.100 | 22.0 | 18.0 | +4.0 |"
            in printed)
    assert "--data.document_masking=false added" in printed and "NCCL_NVLS_ENABLE=0" in printed


def test_the_peer_runs_at_our_global_batch_when_asked(tmp_path, monkeypatch, capsys):
    code, calls, _ = run_fake(tmp_path, monkeypatch, "--peer_global_batch", "ours")
    assert code == 0
    peer_argv = calls[1]["argv"]
    assert (flag(peer_argv, "--mbs"), flag(peer_argv, "--grad_accum")) == ("4", "8")  # 4 x 2 GPUs x 8 = 64
    assert "| train300M_fsdp, bf16, AC none, mbs 4 x 8, 2 GPUs |" in capsys.readouterr().out


def test_a_failed_side_is_reported_and_the_other_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_PEER", "oom")
    code, calls, (record,) = run_fake(tmp_path, monkeypatch, "--order", "peer_first")
    assert code == 0
    assert [Path(c["argv"][0]).name for c in calls] == ["peer.py", "benchmark.py"]
    assert record["peer"]["error"] == "out of memory" and record["ratio"] is None
    assert record["ours"]["tokens_per_sec_per_gpu"] == 1000.0
    assert "| 1,000 | out of memory | - | 20.0 | - | - |" in capsys.readouterr().out


def test_both_sides_failing_exits_non_zero(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PEER", "oom")
    fake = tmp_path / "fake.py"
    fake.write_text("import sys; print('Traceback'); print('RuntimeError: NCCL error'); sys.exit(3)")
    peer = tmp_path / "peer.py"
    peer.write_text("")
    out = tmp_path / "out.jsonl"
    code = ct.main([str(ROOT / "config" / "train300M_fsdp.yaml"), "--peer_script", str(peer), "--launcher",
                    f"{sys.executable} {fake}", "--train.micro_batch_size=4", "--json", str(out)])
    assert code == 1
    record = json.loads(out.read_text())
    assert record["ours"]["error"] == record["peer"]["error"] == "failed, exit 3, last line: RuntimeError: NCCL error"


def test_the_commit_recorded_says_when_the_tree_differs_from_it(tmp_path, monkeypatch):
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "a")
    monkeypatch.setattr(ct, "ROOT", tmp_path)
    (tmp_path / "untracked.txt").write_text("not part of the measured code\n")
    assert re.fullmatch(r"[0-9a-f]{40}", ct.git_commit())
    (tmp_path / "a.py").write_text("x = 2\n")
    assert re.fullmatch(r"[0-9a-f]{40}-modified", ct.git_commit())
    monkeypatch.setattr(ct, "ROOT", tmp_path / "missing")
    assert ct.git_commit() is None


# ---- odd figures, hostile destinations, secrets -------------------------------------------------------------

def test_a_peer_at_zero_tokens_per_second_has_no_ratio_and_loses_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_PEER", "zero")
    code, _, (record,) = run_fake(tmp_path, monkeypatch)
    assert code == 0 and record["ratio"] is None and record["peer"]["tokens_per_sec_per_gpu"] == 0.0
    assert record["memory_diff_gib"] == pytest.approx(2.0)  # 20 GiB ours, 18 the peer's
    assert "| 1,000 | 0 | - | 20.0 | 18.0 | +2.0 |" in capsys.readouterr().out


@pytest.mark.parametrize("side", ["peer", "ours"])
def test_a_garbled_figure_is_no_result_and_the_table_and_record_remain(tmp_path, monkeypatch, capsys, side):
    """"1.2.3 tok/s/GPU" from the peer, or "1.2.3" as our tokens/s in benchmark.py's record: that side has no
    result (its last line named), the other's figures are in the table and the JSON record."""
    monkeypatch.setenv(f"FAKE_{side.upper()}", "garbled")
    code, _, (record,) = run_fake(tmp_path, monkeypatch)
    other = "ours" if side == "peer" else "peer"
    assert code == 0 and record["ratio"] is None and record[side]["error"].startswith("no result, exit 0")
    assert record[other]["tokens_per_sec_per_gpu"] == 1000.0
    if side == "peer":
        assert "1.2.3 tok/s/GPU" in record["peer"]["error"]
    assert "| train300M_fsdp, bf16, AC none, mbs 4 x 8 (peer 4), 2 GPUs |" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["fifo", "folder", "missing folder"])
def test_json_destination_that_is_not_a_file_is_refused_before_the_runs(tmp_path, monkeypatch, capsys, kind):
    """--json naming a FIFO (appending would block until a reader comes, after both runs), a folder, or a file in
    a folder that does not exist: one error line before anything runs."""
    destination = tmp_path / ("missing/out.jsonl" if kind == "missing folder" else "out.jsonl")
    if kind == "fifo":
        os.mkfifo(destination)
    elif kind == "folder":
        destination.mkdir()
    (tmp_path / "peer.py").write_text("")
    argv = [str(ROOT / "config" / "train300M_fsdp.yaml"), "--peer_script", str(tmp_path / "peer.py"), "--launcher",
            f"{sys.executable} {tmp_path / 'never-run.py'}", "--train.micro_batch_size=4", "--json", str(destination)]
    assert ct.main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    what = {"fifo": "a FIFO, not a file", "folder": "a folder, not a file",
            "missing folder": f"the folder {destination.parent} does not exist"}[kind]
    assert line.startswith(f"error: --json {destination}: {what}") and "===" not in captured.out


def test_a_json_destination_that_turns_into_a_fifo_is_refused_without_blocking(tmp_path):
    from safe_io.nofollow import append_line

    fifo = tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as err:  # opened without blocking: no reader, refused at once
        append_line(fifo, "{}")
    assert str(err.value) == f"--json {fifo}: a FIFO, not a file to append results to"


def test_overrides_with_credentials_are_printed_and_recorded_without_them(tmp_path, monkeypatch, capsys):
    """A tracker URI and data URLs with users, passwords and query strings (generated as in test_uri_secrets):
    both runs get them as given; the commands printed, the JSON record's overrides and commands do not."""
    import random

    from tests.test_uri_secrets import leaked, secret_uri

    rng = random.Random(7)
    (uri, secrets), (url, more) = secret_uri(rng), secret_uri(rng, scheme="https", host="data.example.com")
    given = [f"--logging.mlflow_tracking_uri={uri}", f'--data.files=["{url}"]']
    code, calls, (record,) = run_fake(tmp_path, monkeypatch, *given)
    assert code == 0 and all(arg in calls[0]["argv"] for arg in given)  # our run has them
    printed = capsys.readouterr()
    assert leaked(printed.out + printed.err + json.dumps(record), secrets + more) == []
    assert "--logging.mlflow_tracking_uri=http://mlflow.example.com:5000/prefix" in record["overrides"]
    assert "--logging.mlflow_tracking_uri=http://mlflow.example.com:5000/prefix" in record["commands"]["ours"]
    assert '--data.files=["https://data.example.com/prefix"]' in record["overrides"]


def test_benchmarks_own_record_holds_overrides_without_credentials(tmp_path):
    import random

    from tests.test_uri_secrets import leaked, secret_uri

    uri, secrets = secret_uri(random.Random(8))
    cfg = load_config(ROOT / "config" / "train300M_fsdp.yaml", ["--model.vocab_size=32000"])
    out = tmp_path / "ours.jsonl"
    args = benchmark.build_parser().parse_args(["config/train300M_fsdp.yaml", "--json", str(out)])
    args.doc_len = 0
    row = benchmark.summarise("ours", [0.5], 12.5, (4, 1), cfg, 1e15)
    env = types.SimpleNamespace(device=torch.device("cpu"), world_size=2)
    benchmark.report_rounds([row], {"ours": [0.5]}, cfg, env, args,
                            overrides=[f"--logging.mlflow_tracking_uri={uri}", "--train.lr=1e-4"], recipes=[])
    record = json.loads(out.read_text())
    assert leaked(out.read_text(), secrets) == []
    assert record["overrides"] == ["--logging.mlflow_tracking_uri=http://mlflow.example.com:5000/prefix",
                                   "--train.lr=1e-4"]
