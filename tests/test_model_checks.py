"""The model's size against the memory it is built in, checked before anything is allocated, and an
allocation the allocator refuses: each one line naming the model's dimensions. Also a checkpoint whose model
config holds a wrong type, said before any comparison of shapes."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from config import load_config
from fsdp_utils.checkpoint import CheckpointError
from fsdp_utils.checkpoint.base import CheckpointContext
from fsdp_utils.checkpoint.io import read_meta
from fsdp_utils.distributed import DistEnv
from fsdp_utils.parallel.build import ModelMemoryError, build_model
from model import ModelConfig
from tests.distributed_harness import cpu_env, run_ranks
from tests.helpers import ROOT, CountOps

GiB = 2**30
ONE_RANK = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
# 64 blocks of dim 65536 (ffn 174,848) and a 32,000 vocabulary: 2,822,775,046,144 parameters, 11.3 TB in fp32.
HUGE = ["--model.dim=65536", "--model.n_layers=64", "--model.n_heads=64", "--model.n_kv_heads=8",
        "--model.vocab_size=32000", "--run.device=cpu"]


def huge_params() -> int:
    d, ffn, vocab, kv = 65536, 174848, 32000, 8 * 1024  # n_kv_heads * head_dim = 8 * 65536 / 64
    per_block = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d  # wq, wo, wk, wv, the MLP, two norms
    return 64 * per_block + 2 * vocab * d + d


def test_a_model_too_large_for_host_memory_is_refused_before_any_allocation():
    cfg = load_config(None, HUGE)
    assert cfg.model.num_params() == huge_params() == 2_822_775_046_144
    with CountOps() as ops, pytest.raises(ModelMemoryError) as err:
        build_model(cfg, ONE_RANK, host_free=16 * GiB)
    assert sum(ops.counts.values()) == 0  # no tensor was made, let alone allocated
    assert str(err.value) == (
        "the model (dim 65536, 64 layers, ffn 174848, vocab 32000: 2,822,775,046,144 parameters) needs "
        f"{huge_params() * 4 / GiB:,.1f} GiB of host memory for its fp32 weights alone, 16.0 GiB free; use a smaller "
        "model, or more nodes: with several ranks the weights are built on the meta device and sharded")
    assert "\n" not in str(err.value)


def test_a_model_that_fits_is_built():
    cfg = load_config(None, ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.vocab_size=256"])
    weights = cfg.model.num_params() * 4
    built = build_model(cfg, ONE_RANK, host_free=weights)  # exactly enough
    assert sum(p.numel() for p in built.module.parameters()) * 4 == weights
    with pytest.raises(ModelMemoryError):
        build_model(cfg, ONE_RANK, host_free=weights - 1)
    assert build_model(cfg, ONE_RANK, host_free=None).init is None  # nothing to compare with: built directly


def _build_on_two_ranks(rank: int, world_size: int, *, overrides: list[str], host_free: list[list[int]]) -> list[str]:
    """What building the model says on this rank, once per entry of `host_free` (each rank's figure)."""
    lines = []
    for extra, free in zip(([], ["--fsdp.meta_init=false"]), host_free, strict=True):
        try:
            build_model(load_config(None, [*overrides, *extra]), cpu_env(rank, world_size), host_free=free[rank])
            lines.append("built")
        except ModelMemoryError as err:
            lines.append(str(err))
    return lines


@pytest.mark.slow  # two rank processes
def test_ranks_of_one_host_count_together_and_stop_together():
    # 2 ranks on one host, sharded on the meta device: each holds half the weights, the host both halves.
    # Rank 0 alone would say it fits; rank 1 sees too little memory, and both stop with its line.
    overrides = ["--model.dim=512", "--model.n_layers=4", "--model.n_heads=8", "--model.vocab_size=1024"]
    weights = ModelConfig(dim=512, n_layers=4, n_heads=8, vocab_size=1024).num_params() * 4
    # Then without the meta device (fsdp.meta_init=false): every rank builds all of it, the host twice.
    rank0, rank1 = run_ranks(_build_on_two_ranks, 2, overrides=overrides,
                             host_free=[[weights, weights - 4096], [2 * weights - 1] * 2])
    assert rank0 == rank1
    sharded, whole = rank0
    assert sharded.startswith(
        f"the model (dim 512, 4 layers, ffn 1536, vocab 1024: {weights // 4:,} parameters) needs "
        f"{weights / GiB:,.1f} GiB of host memory for its fp32 weights alone (2 ranks x {weights / 2 / GiB:,.1f} GiB)")
    assert whole.endswith(
        "set fsdp.meta_init: true and fsdp.sync_module_states: false so that each rank holds only its shard")


@pytest.mark.slow  # a process of its own, its address space capped
def test_an_allocation_the_allocator_refuses_is_one_line():
    # The memory check passes (a host_free of 1 PiB), but this child's address space is capped a little above
    # what it uses, so the real CPU allocator refuses the model's 1 GiB embedding.
    code = textwrap.dedent("""
        import resource, torch
        from config import load_config
        from fsdp_utils.distributed import DistEnv
        from fsdp_utils.parallel.build import ModelMemoryError, build_model
        cfg = load_config(None, ["--model.vocab_size=65536", "--model.dim=4096", "--model.n_layers=1",
                                 "--model.n_heads=32", "--run.device=cpu"])
        env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
        size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + 256 * 2**20, resource.RLIM_INFINITY))
        try:
            build_model(cfg, env, host_free=2**50)
        except ModelMemoryError as err:
            print(err)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.splitlines()
    assert line.startswith("the model (dim 4096, 1 layers, ffn 11008, vocab 65536: ") and line.endswith(
        "use a smaller model or more ranks"), line
    assert "could not be allocated on cpu (" in line and "can't allocate memory" in line, line


def test_a_checkpoint_model_config_of_the_wrong_type_is_said_before_comparing_shapes(tmp_path):
    # A string "32" in the checkpoint's model config is not "32 here, 32 in the checkpoint". A real checkpoint,
    # since its model config is also held against the tensors it holds.
    path = ROOT / "tests/fixtures/checkpoints_2026_12/full/fsdp_cpt2.pth"
    ours = read_meta(path)["model_config"]
    context = CheckpointContext(tmp_path, ONE_RANK, "full", 1, ours)
    with pytest.raises(CheckpointError) as err:
        context.check_model({"model_config": ours | {"dim": "32"}}, path)
    assert str(err.value) == f"{path}: invalid model_config (dim='32', expected int)"
    context.check_model({"model_config": ours}, path)  # the same config, each field its type: no mismatch


def test_on_gpus_the_share_is_held_against_the_gpu_unless_offloaded_to_the_host(monkeypatch):
    # The GPU's free memory as torch.cuda reports it (16 GiB here), without a GPU: nothing is built.
    from fsdp_utils.parallel.build import _memory_problem

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (16 * GiB, 80 * GiB))
    gpus = DistEnv(rank=0, local_rank=0, world_size=8, local_world_size=8, device=torch.device("cuda", 0))
    problem = _memory_problem(load_config(None, HUGE[:-1]), gpus, host_free=None)
    assert str(problem).startswith("the model (dim 65536, 64 layers") and (
        f"needs {huge_params() * 4 / 8 / GiB:,.1f} GiB of cuda:0 memory for its fp32 weights alone, 16.0 GiB free; "
        "use a smaller model, or more GPUs") in str(problem)
    assert _memory_problem(load_config(None, [*HUGE[:-1], "--fsdp.cpu_offload=true"]), gpus, host_free=None) is None


# ---- a Hugging Face model (model.type=hf): sized from its meta-device skeleton, before any allocation ---------


def hf_config_file(folder, **sizes) -> str:
    """A Llama config.json of the given sizes (over tiny ones), as model.hf_config names it."""
    transformers = pytest.importorskip("transformers")
    tiny = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaConfig(**{**tiny, **sizes}).save_pretrained(folder)
    return str(folder / "config.json")


def test_a_hugging_face_model_too_large_for_host_memory_is_refused_before_any_allocation(tmp_path):
    # hidden_size 2**16: config.json's lower bound (below) fits 80 GiB, the skeleton's exact count does not.
    h = 2**16
    path = hf_config_file(tmp_path, hidden_size=h)
    cfg = load_config(None, ["--model.type=hf", f"--model.hf_config={path}", "--run.device=cpu"])
    # Per layer q, o (h x h), k, v (h x h/2: 2 of 4 heads), the MLP (3 x h x 128), two norms; embedding, head, norm.
    params = 2 * (3 * h * h + 3 * h * 128 + 2 * h) + 2 * 320 * h + h
    with pytest.raises(ModelMemoryError) as err:
        build_model(cfg, ONE_RANK, host_free=80 * GiB)
    assert str(err.value) == (
        f"the model (model.hf_config={path}: hidden_size 65536, intermediate_size 128, num_hidden_layers 2, "
        f"vocab_size 320: {params:,} parameters) needs {2 * params * 4 / GiB:,.1f} GiB of host memory for its fp32 "
        f"weights alone (rank 0's full copy of {params * 4 / GiB:,.1f} GiB and 1 shard of {params * 4 / GiB:,.1f} "
        "GiB), 80.0 GiB free; use a smaller model: rank 0 reads all of its weights")


def test_hugging_face_sizes_past_any_model_s_are_refused_from_config_json_before_building(tmp_path, monkeypatch):
    """A skeleton of 10**6 layers alone takes most of an hour to build on the meta device (a few milliseconds a
    layer): config.json's sizes are held against our own model's bounds before transformers builds anything,
    at --check (hf_problems, before any process group) and in the build on every rank."""
    from fsdp_utils.parallel.hf import HFModelError, hf_problems
    transformers = pytest.importorskip("transformers")

    def no_build(*args, **kwargs):
        raise AssertionError("transformers was asked to build the model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", no_build)
    cases = {"num_hidden_layers": (10**6, "2**16 = 65536"), "vocab_size": (10**9, "2**24 = 16777216"),
             "intermediate_size": (2**22 + 1, "2**22 = 4194304"), "hidden_size": (2**21, "2**20 = 1048576")}
    for key, (value, limit) in cases.items():
        path = hf_config_file(tmp_path / key, **{key: value})
        cfg = load_config(None, ["--model.type=hf", f"--model.hf_config={path}", "--run.device=cpu"])
        line = (f"model.hf_config={path}: config.json's {key}={value} must be a positive integer of at most {limit} "
                f"(past any released model's)")
        assert hf_problems(cfg.model) == [line]
        with pytest.raises(HFModelError) as err:
            build_model(cfg, ONE_RANK, host_free=None)
        assert str(err.value) == line
    # A value of the wrong kind is named too (transformers keeps what config.json says).
    path = hf_config_file(tmp_path / "zero")
    edit_json(path, num_hidden_layers=0)
    cfg = load_config(None, ["--model.type=hf", f"--model.hf_config={path}", "--run.device=cpu"])
    assert hf_problems(cfg.model) == [f"model.hf_config={path}: config.json's num_hidden_layers=0 must be a positive "
                                      "integer of at most 2**16 = 65536 (past any released model's)"]


def edit_json(path, **changes) -> None:
    import json

    path = Path(path)
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_hidden_size_2_to_the_20_is_refused_by_rank_0_s_host_memory_before_building(tmp_path, monkeypatch):
    """hidden_size 2**20 is within bounds, but even config.json's lower bound of the parameters is 4.4e12:
    rank 0, which holds the full fp32 copy, cannot; said at --check and before the skeleton is built."""
    from fsdp_utils.parallel.hf import hf_problems, min_parameters
    transformers = pytest.importorskip("transformers")

    h = 2**20
    path = hf_config_file(tmp_path, hidden_size=h)
    cfg = load_config(None, ["--model.type=hf", f"--model.hf_config={path}", "--run.device=cpu"])
    # Untied embedding and head (2 x 320 x h); per layer q and o (h x 4 heads x h/4 each) and two MLP matrices
    # (h x 128): the key/value projections, the gate and the norms on top are not counted.
    lower = 2 * 320 * h + 2 * (2 * h * h + 2 * h * 128)
    assert min_parameters(transformers.AutoConfig.from_pretrained(path)) == lower == 4_399_254_470_656
    line = (f"the model (model.hf_config={path}: hidden_size 1048576, intermediate_size 128, num_hidden_layers 2, "
            f"vocab_size 320: at least {lower:,} parameters) needs {lower * 4 / GiB:,.1f} GiB of host memory for its "
            f"fp32 weights alone (rank 0's full copy of at least {lower * 4 / GiB:,.1f} GiB), 64.0 GiB free; use a "
            "smaller model: rank 0 reads all of its weights")
    assert hf_problems(cfg.model, host_free=64 * GiB) == [line]
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config",
                        lambda *a, **k: pytest.fail("transformers was asked to build the model"))
    with pytest.raises(ModelMemoryError) as err:
        build_model(cfg, ONE_RANK, host_free=64 * GiB)
    assert str(err.value) == line
    # Another host's ranks hold no full copy: only rank 0's host checks it (its shards, once the skeleton is built).
    other_host = DistEnv(rank=2, local_rank=0, world_size=4, local_world_size=2, device=torch.device("cpu"))
    from fsdp_utils.parallel.build import _hf_size_problem

    assert _hf_size_problem(cfg.model, other_host, host_free=64 * GiB) is None


def test_a_hugging_face_model_is_held_against_each_host_s_share(tmp_path):
    from fsdp_utils.parallel import hf
    from fsdp_utils.parallel.build import _hf_memory_problem

    cfg = load_config(None, ["--model.type=hf", f"--model.hf_config={hf_config_file(tmp_path)}", "--run.device=cpu"])
    model = hf.build_for_sharding(cfg, ONE_RANK).module
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert _hf_memory_problem(cfg, ONE_RANK, model, host_free=2 * weights) is None  # exactly enough

    def host(rank: int) -> DistEnv:  # 2 hosts of 2 ranks
        return DistEnv(rank=rank, local_rank=rank % 2, world_size=4, local_world_size=2, device=torch.device("cpu"))

    # Rank 0's host holds its full copy besides two quarters; the other host only its two quarters.
    assert _hf_memory_problem(cfg, host(1), model, host_free=weights + weights // 2) is None
    assert "(rank 0's full copy of " in str(_hf_memory_problem(cfg, host(1), model, host_free=weights))
    assert _hf_memory_problem(cfg, host(3), model, host_free=weights // 2) is None
    assert str(_hf_memory_problem(cfg, host(3), model, host_free=weights // 2 - 1)).endswith(
        "(2 shards of 0.0 GiB), 0.0 GiB free; use a smaller model, or more nodes")


@pytest.mark.parametrize("changes", [
    dict(hidden_act="nonesuch"),  # an activation transformers does not have
    dict(rope_parameters={"rope_type": "nonesuch", "rope_theta": 10000.0}),  # a rotary scaling it does not have
])
def test_a_config_json_transformers_cannot_build_is_one_line(tmp_path, changes):
    from fsdp_utils.parallel.hf import HFModelError

    path = hf_config_file(tmp_path)
    edit_json(path, **changes)  # transformers reads these without a check, and fails on them while building
    cfg = load_config(None, ["--model.type=hf", f"--model.hf_config={path}", "--run.device=cpu"])
    with pytest.raises(HFModelError) as err:
        build_model(cfg, ONE_RANK, host_free=None)
    assert str(err.value) == (f"model.hf_config={path}: hidden_size 64, intermediate_size 128, num_hidden_layers 2, "
                              "vocab_size 320: transformers cannot build this model (KeyError: 'nonesuch'); correct "
                              "its config.json")


def test_on_gpus_a_hugging_face_model_s_share_is_held_against_the_gpu(tmp_path, monkeypatch):
    from fsdp_utils.parallel import hf
    from fsdp_utils.parallel.build import _hf_memory_problem

    cfg = load_config(None, ["--model.type=hf", f"--model.hf_config={hf_config_file(tmp_path)}"])
    model = hf.build_for_sharding(cfg, ONE_RANK).module
    weights = sum(p.numel() for p in model.parameters()) * 4
    gpus = DistEnv(rank=0, local_rank=0, world_size=8, local_world_size=8, device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (weights // 8 - 1, 80 * GiB))
    assert str(_hf_memory_problem(cfg, gpus, model, host_free=None)).endswith(
        "GiB of cuda:0 memory for its fp32 weights alone, 0.0 GiB free; use a smaller model, or more GPUs")
    # Offloaded, the shards join rank 0's full copy in host memory.
    cfg.fsdp.cpu_offload = True
    assert _hf_memory_problem(cfg, gpus, model, host_free=2 * weights) is None
    assert "(rank 0's full copy of 0.0 GiB and 8 shards of 0.0 GiB)" in str(
        _hf_memory_problem(cfg, gpus, model, host_free=2 * weights - 1))


@pytest.mark.parametrize("tie", [False, True])
def test_a_hugging_face_model_s_line_at_startup_reads_like_ours(tmp_path, caplog, tie):
    """Its parameters, counted from the skeleton, its class and folder, and config.json's sizes: not the signature
    dict checkpoints store."""
    path = hf_config_file(tmp_path, tie_word_embeddings=tie)
    cfg = load_config(None, ["--model.type=hf", f"--model.hf_config={path}", "--run.device=cpu"])
    with caplog.at_level(logging.INFO, logger="train"):
        built = build_model(cfg, ONE_RANK, host_free=None)
    # Per layer q, o (64 x 64), k, v (64 x 32), the MLP (3 x 64 x 128), two norms; the final norm; the embedding
    # (320 x 64), and the head beside it unless tied.
    body = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    embeddings = 320 * 64 * (1 if tie else 2)
    assert sum(p.numel() for p in built.module.parameters()) == body + embeddings
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model:")]
    tied = ", tied embeddings" if tie else ""
    assert lines == [f"model: {body + embeddings:,} parameters ({body:,} without embeddings), LlamaForCausalLM from "
                     f"{path}: 2 layers, hidden 64, heads 4/2 kv, ffn 128, vocab 320{tied}"]
