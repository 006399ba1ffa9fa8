"""Asynchronous sharded saves (checkpoint.async_save): host staging and host-memory checks as units, then
real train_fsdp.py jobs (torchrun, gloo on the CPU): save-then-resume is bit-identical, a SIGKILL during
the background write keeps the previous checkpoint as `latest`, a failed write is reported with the
checkpoint's name (stop or continue), a stop signal waits for the save in flight, and a save waits for
the one in flight (logged).

The background write is slowed down or made to fail, and staging made to fail, by the test-only faults
of tests/fault_injection.py.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from fsdp_utils.checkpoint import io as checkpoint_io
from fsdp_utils.checkpoint.async_save import resolve_async_save
from fsdp_utils.checkpoint.staging import HostStaging
from fsdp_utils.host_memory import host_memory
from tests.helpers import losses, read_metrics, run_train
from tests.test_checkpoint import as_full, assert_identical, checkpoint_names
from tests.test_failures import logged_steps, poll, start_ranks

ASYNC = ("--checkpoint.format=sharded", "--checkpoint.async_save=true")


# ---- units: host memory ------------------------------------------------------------------------------


def fake_machine(root: Path, *, mem_total_gib: float, mem_available_gib: float, blocks: int = 0,
                 cgroup: str = "0::/", files: dict[str, str] | None = None) -> tuple[Path, Path]:
    """A /proc and /sys of a machine: meminfo, this process's cgroup line, memory blocks of 128 MiB."""
    proc, sys_root = root / "proc", root / "sys"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       {int(mem_total_gib * 2**20)} kB\nMemFree:  1000 kB\n"
                                  f"MemAvailable:   {int(mem_available_gib * 2**20)} kB\n")
    (proc / "self/cgroup").write_text(cgroup + "\n")
    memory = sys_root / "devices/system/memory"
    memory.mkdir(parents=True)
    (memory / "block_size_bytes").write_text("8000000\n")  # hex: 128 MiB
    for i in range(blocks):
        (memory / f"memory{i}").mkdir()
        (memory / f"memory{i}/state").write_text("online\n")
    for name, text in (files or {}).items():
        (sys_root / name).parent.mkdir(parents=True, exist_ok=True)
        (sys_root / name).write_text(text)
    return proc, sys_root


def test_host_memory_of_a_vm_whose_memory_grows_as_used(tmp_path):
    # A 256 GiB VM that shows MemTotal 31 GiB at the start (seen on the GPU machines): its memory
    # blocks still cover all 256 GiB, so 256 - (31 - 29) = 254 GiB can be had, not MemAvailable's 29.
    proc, sys_root = fake_machine(tmp_path, mem_total_gib=31, mem_available_gib=29, blocks=2048)
    mem = host_memory(proc=proc, sys_root=sys_root)
    assert mem.available == 254 * 2**30 and mem.limit == 256 * 2**30 and mem.exact
    assert "memory blocks" in mem.source


def test_host_memory_of_a_plain_machine_is_mem_available(tmp_path):
    proc, sys_root = fake_machine(tmp_path, mem_total_gib=64, mem_available_gib=40, blocks=512)  # 64 GiB of blocks
    mem = host_memory(proc=proc, sys_root=sys_root)
    assert mem.available == 40 * 2**30 and mem.source == "MemTotal"


def test_host_memory_under_a_cgroup_limit(tmp_path):
    # A Slurm job or container limited to 64 GiB, 10 GiB charged of which 4 GiB reclaimable page cache:
    # 64 - (10 - 4) = 58 GiB, less than the machine's 254.
    gib = 2**30
    proc, sys_root = fake_machine(tmp_path, mem_total_gib=256, mem_available_gib=254, blocks=2048, cgroup="0::/job",
                                  files={"fs/cgroup/job/memory.max": f"{64 * gib}\n",
                                         "fs/cgroup/job/memory.current": f"{10 * gib}\n",
                                         "fs/cgroup/job/memory.stat": f"anon 123\ninactive_file {4 * gib}\n"})
    mem = host_memory(proc=proc, sys_root=sys_root)
    assert mem.available == 58 * gib and mem.source == "the memory cgroup's limit"
    # "max": no limit, the machine's figure.
    (sys_root / "fs/cgroup/job/memory.max").write_text("max\n")
    assert host_memory(proc=proc, sys_root=sys_root).available == 254 * gib


def test_host_memory_hot_plugged_on_demand_is_not_exact(tmp_path):
    proc, sys_root = fake_machine(tmp_path, mem_total_gib=31, mem_available_gib=29, blocks=248,
                                  files={"bus/virtio/drivers/virtio_mem/virtio3/uevent": ""})
    assert not host_memory(proc=proc, sys_root=sys_root).exact


def test_a_node_too_small_for_the_staging_is_refused_at_the_start(monkeypatch, caplog):
    """Two ranks on one node (the gather faked): 2 x 48 GiB needed against what the node can give."""
    from fsdp_utils.checkpoint import async_save as host_memory_module
    from fsdp_utils.checkpoint.errors import CheckpointError
    from fsdp_utils.distributed import DistEnv

    gib = 2**30
    env = DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2, device=torch.device("cpu"))
    monkeypatch.setattr(host_memory_module.dist, "all_gather_object",
                        lambda rows, row: rows.__setitem__(slice(None), [row] * len(rows)))

    def machine(available_gib, *, exact=True):
        mem = host_memory_module.HostMemory(available=available_gib * gib, limit=256 * gib, in_use=4 * gib,
                                            source="the test", exact=exact)
        monkeypatch.setattr(host_memory_module, "host_memory", lambda: mem)

    machine(200)
    assert host_memory_module.check_host_memory(48 * gib, env, what="w").startswith("96.0 GiB on ")
    machine(90)
    with pytest.raises(CheckpointError,
                       match=r"needs 96.0 GiB of host memory on .* \(2 rank\(s\) x 48.0 GiB: w\) but only "
                                              r"90.0 GiB is free \(256.0 GiB from the test, 4.0 GiB in use\); set "
                                              r"checkpoint.async_save=false"):
        host_memory_module.check_host_memory(48 * gib, env, what="w")
    machine(90, exact=False)  # memory plugged in on demand: no ceiling to trust, a warning only
    host_memory_module.check_host_memory(48 * gib, env, what="w")
    assert "adds memory as it is used" in caplog.text
    # The process writer: /dev/shm too small.
    machine(200)
    monkeypatch.setattr(host_memory_module.shutil, "disk_usage", lambda path: shutil_usage(free=64 * gib))
    monkeypatch.setattr(host_memory_module.os.path, "isdir", lambda path: True)
    with pytest.raises(CheckpointError, match=r"through /dev/shm: 96.0 GiB needed on .*, 64.0 GiB free there; use "
                                              r"checkpoint.async_writer=thread"):
        host_memory_module.check_host_memory(48 * gib, env, what="w", shm_per_rank=48 * gib)


def shutil_usage(*, free: int):
    import collections

    return collections.namedtuple("usage", "total used free")(free, 0, free)


def test_async_save_is_on_by_default_for_sharded_checkpoints_on_gpus():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_async_save("auto", fmt="sharded", device=cuda)
    assert not resolve_async_save("auto", fmt="sharded", device=cpu)
    assert not resolve_async_save("auto", fmt="full", device=cuda)
    assert not resolve_async_save(True, fmt="full", device=cpu)
    assert resolve_async_save(True, fmt="sharded", device=cpu)
    assert not resolve_async_save(False, fmt="sharded", device=cuda)


# ---- units: staging ------------------------------------------------------------------------------------


def test_staging_copies_live_tensors_into_one_reused_arena():
    weight, moment, step = torch.randn(3, 5), torch.randn(7), torch.tensor(3.0)
    made_for_the_save = torch.randn(4)  # e.g. FSDP1's offloaded piece: no live storage
    state = {"model": {"w": weight}, "optimizer": {"state": {"w": {"exp_avg": moment, "step": step},
                                                             "v": {"piece": made_for_the_save}},
                                                   "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95),
                                                                     "params": ["w"]}]}}
    live = {t.untyped_storage().data_ptr() for t in (weight, moment, step)}  # what training will change
    staging = HostStaging(pin=False, share=False)
    staging.reserve(1 << 20)
    arena = staging.nbytes
    staged = staging.stage(state, live=live)
    # Live tensors are copies in the arena; the piece made for the save and plain values pass as they are.
    assert staged["model"]["w"] is not weight and torch.equal(staged["model"]["w"], weight)
    assert staged["optimizer"]["state"]["v"]["piece"] is made_for_the_save
    assert staged["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert staging.last.copied == (15 + 7 + 1) * 4 and staging.last.passed == 4 * 4 and staging.last.allocated == 0
    # Training goes on: the staged copies keep the values of the save.
    before = staged["model"]["w"].clone()
    weight.add_(1.0)
    assert torch.equal(staged["model"]["w"], before)
    # The next save reuses the same memory (no allocation) and sees the new values.
    ptr = staged["model"]["w"].data_ptr()
    again = staging.stage(state, live=live)
    assert again["model"]["w"].data_ptr() == ptr and torch.equal(again["model"]["w"], weight)
    assert staging.nbytes == arena and staging.last.allocated == 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's note on a save without a process group
def test_dcp_writes_the_thread_writers_staged_tensors_without_copying_them(tmp_path, monkeypatch):
    # DCP's writer copies every tensor whose storage is larger than the tensor before writing it, and the
    # host's heap keeps those copies: a staged tensor on the whole arena's storage was held twice during a save.
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(64, 48), "b": torch.randn(48).to(torch.bfloat16), "step": torch.tensor(7.0)}
    staging = HostStaging(pin=False, share=False)
    staged = staging.stage(state, live={t.untyped_storage().data_ptr() for t in state.values()})
    arena = (staging._raw.data_ptr(), staging._raw.data_ptr() + staging.nbytes)
    for t in staged.values():  # each in the arena, on a storage of its own size
        assert arena[0] <= t.data_ptr() < arena[1] and t.untyped_storage().nbytes() == t.nbytes
    copies = []
    clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: copies.append(t.shape) or clone(t, *a, **k))
    dcp.save(staged, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    monkeypatch.undo()
    assert copies == []
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_staging_grows_a_reserve_too_small_and_shares_everything_for_the_process_writer():
    weight = torch.randn(1000, 300)  # 1.2 MB: more than the 4 KiB reserved
    piece = torch.randn(10)
    staging = HostStaging(pin=False, share=True)
    staging.reserve(4096)
    staged = staging.stage({"w": weight, "piece": piece}, live={weight.untyped_storage().data_ptr()})
    assert staging.last.allocated >= weight.numel() * 4 and staging.nbytes >= staging.last.allocated
    # The process writer gets every tensor through the one shared arena, the piece made for the save too.
    assert staged["piece"] is not piece and torch.equal(staged["piece"], piece)
    assert staged["w"].is_shared() and staged["piece"].is_shared()
    assert staged["w"].untyped_storage().data_ptr() == staged["piece"].untyped_storage().data_ptr()


class WrappedWeight(torch.Tensor):
    """A tensor subclass built as torchao's FP8 weights are: no storage of its own, its data in an inner
    tensor, declared through the flatten/unflatten protocol. Staging knows nothing of this class."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device,
                                                   strides=inner.stride())

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return WrappedWeight(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, WrappedWeight) else x  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


@pytest.mark.parametrize("share", [False, True], ids=["thread-writer", "process-writer"])
def test_staging_copies_tensor_subclasses_it_does_not_know(share):
    # Such a tensor has no storage to compare or copy (its untyped_storage() raises): the staging finds its
    # data through the protocol, stages a twin of the same class, and the live-storage check sees the inner
    # tensor as the training state it is.
    weight = WrappedWeight(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    with pytest.raises(RuntimeError):
        weight.untyped_storage().data_ptr()
    from fsdp_utils.checkpoint.staging import storage_tensors
    (inner,) = storage_tensors(weight)
    assert inner is weight.inner
    staging = HostStaging(pin=False, share=share)
    staged = staging.stage({"w": weight, "plain": torch.ones(2)}, live={inner.untyped_storage().data_ptr()})
    assert type(staged["w"]) is WrappedWeight and torch.equal(staged["w"].inner, weight.inner)
    weight.inner.add_(1)  # training goes on: the staged copy keeps the values of the save
    assert torch.equal(staged["w"].inner, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert staged["w"].inner.untyped_storage().data_ptr() != inner.untyped_storage().data_ptr()
    again = staging.stage({"w": weight, "plain": torch.ones(2)}, live={inner.untyped_storage().data_ptr()})
    assert torch.equal(again["w"].inner, weight.inner) and staging.last.allocated == 0  # the arena is reused


# ---- real jobs ---------------------------------------------------------------------------------------------

STEPS = 6
SPLIT = 3


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, corpus, dataset_dir):
    """Losses of uninterrupted runs without checkpoints, by number of ranks and FSDP version (FSDP1 and FSDP2
    add the same gradients in another order: not bit-identical to each other), made on first use."""
    cache: dict[tuple, dict[int, float]] = {}

    def get(nproc: int, version: int = 1, steps: int = STEPS, optimizer: str = "adamw") -> dict[int, float]:
        key = (nproc, version, steps, optimizer)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"baseline{nproc}-{version}-{steps}-{optimizer}")
            run_train(f"--train.max_steps={steps}", f"--fsdp.version={version}", f"--train.optimizer={optimizer}",
                      nproc=nproc, out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
            cache[key] = losses(out)
        return cache[key]
    return get


@pytest.mark.slow
# FSDP1 with the process writer is left to the GPU matrix (tests/test_gpu_matrix.py), which trains, saves
# and resumes every combination of version and writer.
@pytest.mark.parametrize("version, writer, nproc, optimizer", [
    (1, "thread", 2, "adamw"), (2, "thread", 2, "adamw"), (2, "process", 2, "adamw"), (1, "thread", 1, "adamw"),
    (2, "thread", 2, "muon")])
def test_async_save_then_resume_is_bit_identical(version, writer, nproc, optimizer, baselines, corpus, dataset_dir,
                                                 tmp_path):
    """Saved in the background at steps 3 and 6, each write slowed by 1 s so that training runs on during
    it and the save of step 6 has to wait for the one of step 3 (logged). The losses are those of a run
    without checkpoints; resuming from step 3 in a fresh process reproduces steps 4-6 exactly, and ends in
    the same model, optimizer, data position and RNG state, bit for bit."""
    baseline = baselines(nproc, version, optimizer=optimizer)
    common = (f"--train.max_steps={STEPS}", *ASYNC, f"--fsdp.version={version}", f"--checkpoint.async_writer={writer}",
              f"--train.optimizer={optimizer}")
    saved = tmp_path / "saved"
    proc = run_train(*common, f"--checkpoint.interval={SPLIT}", nproc=nproc, out_dir=saved, corpus=corpus,
                     dataset_dir=dataset_dir, faults={"write": {"delay_s": 1}})
    assert losses(saved) == baseline
    assert checkpoint_names(saved) == ["fsdp_sharded_cpt3", "fsdp_sharded_cpt6"]
    assert "waiting for the save of fsdp_sharded_cpt3, still being written" in proc.stderr, proc.stderr[-3000:]
    assert "waited " in proc.stderr and "written in the background" in proc.stderr
    for name in checkpoint_names(saved):
        checkpoint_io.verify(saved / name)  # every file's CRC32, computed in the background, matches

    resumed = tmp_path / "resumed"
    proc = run_train(*common, f"--resume_from={saved / 'fsdp_sharded_cpt3'}", nproc=nproc, out_dir=resumed,
                     corpus=corpus, dataset_dir=dataset_dir)
    assert f"loaded checkpoint {saved / 'fsdp_sharded_cpt3'} " in proc.stderr
    assert losses(resumed) == {step: baseline[step] for step in range(SPLIT + 1, STEPS + 1)}
    mine = as_full(resumed / "fsdp_sharded_cpt6", tmp_path / "mine.pth")
    theirs = as_full(saved / "fsdp_sharded_cpt6", tmp_path / "theirs.pth")
    for key in ("model", "optimizer", "train_state", "rng"):
        assert_identical(mine[key], theirs[key], key)


N = 16


@pytest.mark.slow
def test_sigkill_during_an_async_save_keeps_the_previous_checkpoint(baselines, corpus, dataset_dir, tmp_path):
    """The write of step 8 hangs in the background (60 s); training goes on past step 8 and the job is
    killed (-9, every process) while the write is in flight: fsdp_sharded_cpt4 stays the newest complete
    checkpoint, the partial one is only a .tmp- folder, and `latest` continues exactly from step 4."""
    reference = baselines(2, steps=N)
    out = tmp_path / "out"
    args = (f"--train.max_steps={N}", *ASYNC, "--checkpoint.interval=4", "--checkpoint.keep_last_n=0")
    job = start_ranks(*args, nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, log_dir=tmp_path / "run",
                      faults={"write": {"step": 8, "delay_s": 60}})
    try:
        # Steps after 8 logged while its write hangs: training did not wait for it.
        poll(lambda: (s := logged_steps(out)) and s[-1] >= 10 and (out / ".tmp-fsdp_sharded_cpt8").is_dir(),
             job=job, timeout=180, what="step 10 with the save of step 8 in flight")
        assert not (out / "fsdp_sharded_cpt8").exists()
    finally:
        job.kill()
    assert checkpoint_names(out) == [".tmp-fsdp_sharded_cpt8", "fsdp_sharded_cpt4"]
    assert not (out / ".tmp-fsdp_sharded_cpt8" / "meta.json").exists()

    rows_before = len(read_metrics(out))
    proc = run_train(*args, "--resume_from=latest", nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
    assert f"loaded checkpoint {out / 'fsdp_sharded_cpt4'} " in proc.stderr
    assert "removing incomplete checkpoint" in proc.stderr
    got = {r["step"]: r["loss"] for r in read_metrics(out)[rows_before:] if "loss" in r}
    assert got == {step: reference[step] for step in range(5, N + 1)}
    assert checkpoint_names(out) == [f"fsdp_sharded_cpt{s}" for s in (12, 16, 4, 8)]  # sorted as text


@pytest.mark.slow
def test_stop_signal_waits_for_the_save_in_flight(corpus, dataset_dir, tmp_path):
    """SIGTERM while the save of step 4 is still being written (5 s): the job saves at the step it stops
    at, after waiting for the save in flight, and exits 0 with both checkpoints complete and verified."""
    out = tmp_path / "out"
    args = ("--train.max_steps=40", *ASYNC, "--checkpoint.interval=4", "--checkpoint.keep_last_n=0")
    job = start_ranks(*args, nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, log_dir=tmp_path / "run",
                      faults={"write": {"step": 4, "delay_s": 5}})
    try:
        poll(lambda: (s := logged_steps(out)) and s[-1] >= 5, job=job, timeout=180, what="step 5")
        assert (out / ".tmp-fsdp_sharded_cpt4").is_dir() and not (out / "fsdp_sharded_cpt4").exists()
        os.kill(job.workers()[1], signal.SIGTERM)
        assert job.wait(timeout=120) == 0, job.stderr[-4000:]
    finally:
        job.kill()
    stderr = job.stderr
    k = logged_steps(out)[-1]
    assert k < 40 and f"stopped by a signal at step {k}" in stderr, stderr[-4000:]
    assert "waiting for the save of fsdp_sharded_cpt4, still being written" in stderr, stderr[-4000:]
    names = checkpoint_names(out)
    assert "fsdp_sharded_cpt4" in names and f"fsdp_sharded_cpt{k}" in names
    assert not any(n.startswith(".tmp-") for n in names)
    for name in names:
        checkpoint_io.verify(out / name)
        assert (out / name / "meta.json").is_file()


def resumes_exactly(saved: Path, step: int, baseline: dict, *, corpus, dataset_dir, tmp_path) -> None:
    """A fresh job resumed from `saved` at `step` reproduces the uninterrupted losses after it."""
    resumed = tmp_path / f"resumed{step}"
    run_train(f"--train.max_steps={STEPS}", *ASYNC, f"--resume_from={saved}", nproc=2, out_dir=resumed, corpus=corpus,
              dataset_dir=dataset_dir)
    assert losses(resumed) == {s: baseline[s] for s in range(step + 1, STEPS + 1)}


@pytest.mark.slow
@pytest.mark.parametrize("fault, how", [
    ({"stage_fail": [2]}, "cannot stage the checkpoint in host memory (RuntimeError: injected staging failure"),
    ({"write": {"step": 2, "fail": True}},
     "the background write failed (rank 0: OSError: [Errno 5] injected write failure"),
], ids=["staging", "write"])
def test_a_failed_async_save_saves_the_same_step_synchronously(fault, how, baselines, corpus, dataset_dir, tmp_path):
    """The save of step 2 fails in the background machinery (its staging, or its write on every rank): the
    same step is saved synchronously at once (one warning with the cause), training goes on with the
    losses of a run without checkpoints, the later interval save is asynchronous again, the final save
    (step 6) synchronous; resuming from the fallback's checkpoint continues exactly."""
    out = tmp_path / "out"
    proc = run_train(f"--train.max_steps={STEPS}", *ASYNC, "--checkpoint.interval=2", "--checkpoint.keep_last_n=0",
                     nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir, faults=fault)
    assert f"{out / 'fsdp_sharded_cpt2'}: {how}" in proc.stderr, proc.stderr[-4000:]
    assert "saving step 2 synchronously instead" in proc.stderr or "writing it again synchronously" in proc.stderr
    assert losses(out) == baselines(2)
    assert checkpoint_names(out) == ["fsdp_sharded_cpt2", "fsdp_sharded_cpt4", "fsdp_sharded_cpt6"]
    assert "checkpoint fsdp_sharded_cpt4: written in the background" in proc.stderr
    assert "checkpoint fsdp_sharded_cpt6: written in the background" not in proc.stderr  # the last save: synchronous
    for name in checkpoint_names(out):
        checkpoint_io.verify(out / name)
    resumes_exactly(out / "fsdp_sharded_cpt2", 2, baselines(2), corpus=corpus, dataset_dir=dataset_dir,
                    tmp_path=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_save_that_fails_in_the_background_and_again_synchronously(policy, baselines, corpus, dataset_dir, tmp_path):
    """The write of step 4 fails in the background and its synchronous retry fails too. stop: one error line
    naming the checkpoint and both causes, exit 1, fsdp_sharded_cpt2 intact and nothing half-written;
    continue: one error line, training and the later saves go on, the losses as without checkpoints."""
    out = tmp_path / "out"
    proc = run_train(f"--train.max_steps={STEPS}", *ASYNC, "--checkpoint.interval=2",
                     f"--checkpoint.on_async_error={policy}", "--checkpoint.keep_last_n=0", nproc=2, out_dir=out,
                     corpus=corpus, dataset_dir=dataset_dir, check=False,
                     faults={"write": {"step": 4, "fail": True}, "sync_write_fail": [4]})
    message = (f"{out / 'fsdp_sharded_cpt4'}: the background write failed (rank 0: OSError: [Errno 5] injected "
               "write failure")
    if policy == "stop":
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-4000:]
        assert message in errors[0] and "the synchronous retry failed too" in errors[0], errors
        assert "injected synchronous write failure" in errors[0] and "checkpoint.on_async_error=stop" in errors[0]
        assert checkpoint_names(out) == ["fsdp_sharded_cpt2"]
        checkpoint_io.verify(out / "fsdp_sharded_cpt2")
    else:
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "training goes on (checkpoint.on_async_error=continue)" in proc.stderr
        assert checkpoint_names(out) == ["fsdp_sharded_cpt2", "fsdp_sharded_cpt6"]
        assert losses(out) == baselines(2)


@pytest.mark.slow
def test_state_that_cannot_be_staged_at_the_start_makes_every_save_synchronous(
        baselines, corpus, dataset_dir, tmp_path):
    """The staging tried before step 1 fails: one warning before training, then every save is synchronous,
    and the run is the same as without checkpoints."""
    out = tmp_path / "out"
    proc = run_train(f"--train.max_steps={STEPS}", *ASYNC, "--checkpoint.interval=3", nproc=2, out_dir=out,
                     corpus=corpus, dataset_dir=dataset_dir, faults={"stage_fail": [0]})
    warning = "checkpoint.async_save: this run's state cannot be staged in host memory (RuntimeError: injected staging"
    assert warning in proc.stderr and proc.stderr.index(warning) < proc.stderr.index("step 1/"), proc.stderr[-4000:]
    assert ": written in the background" not in proc.stderr
    assert losses(out) == baselines(2)
    assert checkpoint_names(out) == ["fsdp_sharded_cpt3", "fsdp_sharded_cpt6"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_no_room_for_a_checkpoint_stops_the_run_before_step_1(fmt, corpus, dataset_dir, tmp_path):
    """A disk without room for one checkpoint (its free space shown as 1 MiB): one error line before the first
    step, exit 1, no checkpoint and no step trained."""
    out = tmp_path / "out"
    proc = run_train(f"--train.max_steps={STEPS}", f"--checkpoint.format={fmt}", "--checkpoint.interval=3", nproc=2,
                     out_dir=out, corpus=corpus, dataset_dir=dataset_dir, check=False,
                     faults={"disk_free_bytes": 2**20})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-4000:]
    assert errors[0].startswith(f"error: {out}: not enough disk space to save a checkpoint (") and \
        "stopped before the first training step" in errors[0], errors[0]
    assert "step 1/" not in proc.stderr and checkpoint_names(out) == []




# ---- units: the start of the run -------------------------------------------------------------------------


def test_a_file_size_limit_on_the_shared_arena_falls_back_to_synchronous_saves(tmp_path, caplog):
    """The process writer's staging arena is one file in /dev/shm: under a file size limit (RLIMIT_FSIZE)
    smaller than the state it cannot be made. Asynchronous saves turn off with the one warning before step 1,
    and saves are synchronous."""
    import dataclasses
    import resource

    import torch.distributed as dist

    from config import CheckpointConfig
    from fsdp_utils.checkpoint.async_save import HAS_PROCESS_WRITER
    from fsdp_utils.checkpoint.manager import CheckpointManager, Contents, TrainState
    from fsdp_utils.checkpoint.staging import arena_bytes
    from tests.test_checkpoint_input import CONFIG, ENV, model_and_optimizer

    if not HAS_PROCESS_WRITER:
        pytest.skip("this torch has no process writer")
    limit = 16 << 10
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    manager = None
    try:
        model, optimizer = model_and_optimizer()
        assert arena_bytes(model, optimizer) > limit  # the arena must exceed the limit for the test to mean anything
        manager = CheckpointManager(CheckpointConfig(format="sharded", keep_last_n=0, async_save=True,
                                                     async_writer="process"),
                                    tmp_path, contents=Contents(model, optimizer, TrainState(step=1, samples_seen=8,
                                                                                          tokens_seen=64)),
                                    model_config=dataclasses.asdict(CONFIG), env=ENV)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            manager.prepare_saving()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert not manager.background.enabled and manager.background.failed
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and "cannot be staged in host memory" in warned[0], warned
        assert "File too large" in warned[0] and "every save of this run is synchronous" in warned[0], warned
        saved = manager.save()
        assert saved == tmp_path / "fsdp_sharded_cpt1" and checkpoint_io.read_meta(saved)["train_state"]["step"] == 1
    finally:
        if manager is not None:
            manager.close()
        dist.destroy_process_group()
