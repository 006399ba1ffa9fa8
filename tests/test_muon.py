"""MuonAdamW (fsdp_utils/train/muon.py) against torch's own optimizers: torch.optim.Muon for the matrices and
torch.optim.AdamW for the rest, single-process and under FSDP2 at 2 and 3 gloo ranks (uneven and empty shards), on
an HSDP (replicate, shard) mesh, and across a DCP save at 2 ranks and load at 3.

The multi-rank tests set the gradients themselves (the same full tensors on every rank, seeded by step and
parameter, sharded like the parameters) instead of running a forward pass: the optimizer then sees exactly the
reference's inputs, and any difference is the optimizer's. A sharded run equals one process's MuonAdamW to float
rounding, and torch's optimizers to the rounding of Newton-Schulz in bf16 (BF16_NS_RTOL)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fsdp_utils.train.muon import (
    FSDP1_PROBLEM,
    MuonAdamW,
    chunk_rows,
    fused_row_splits,
    sharding_problem,
    split_parameters,
)

LR, MUON_DECAY, ADAMW_DECAY, BETAS = 0.02, 0.1, 0.01, (0.9, 0.95)
FUSED_SPLITS = (5, 2, 2)  # Block.fused: three matrices stacked by rows, like our blocks' wqkv
NUM_STEPS = 3


class Block(nn.Module):
    """Rows that 2 and 3 ranks do not divide evenly (7, 9), a matrix whose third shard is empty on 3 ranks
    (4 rows: 2, 2, 0), two matrices of one shape and a third of its transpose (one Newton-Schulz batch), a
    fused matrix, a bias and a norm."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 7)
        self.b = nn.Linear(6, 7, bias=False)
        self.c = nn.Linear(7, 6, bias=False)
        self.d = nn.Linear(6, 4, bias=False)
        self.fused = nn.Linear(6, sum(FUSED_SPLITS), bias=False)
        self.norm = nn.LayerNorm(6)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.output = nn.Linear(6, 10, bias=False)


MATRICES_PER_BLOCK = 4 + len(FUSED_SPLITS)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def groups(net: Net) -> tuple[list[dict], dict]:
    """MuonAdamW's groups (Muon: the blocks' linear weights; AdamW with decay: embedding and output; without:
    biases and norms) and the fused matrix's row splits."""
    split = split_parameters(net, net.blocks)
    decay = [p for p in split.others if p.ndim == 2]
    no_decay = [p for p in split.others if p.ndim != 2]
    rows = {block.fused.weight: FUSED_SPLITS for block in net.blocks}
    return [{"params": split.matrices, "use_muon": True, "weight_decay": MUON_DECAY},
            {"params": decay, "use_muon": False, "weight_decay": ADAMW_DECAY},
            {"params": no_decay, "use_muon": False, "weight_decay": 0.0}], rows


def make_optimizer(net: Net, adjust_lr_fn: str = "match_rms_adamw", nesterov: bool = True) -> MuonAdamW:
    param_groups, rows = groups(net)
    return MuonAdamW(param_groups, lr=LR, betas=BETAS, row_splits=rows, adjust_lr_fn=adjust_lr_fn,
                     nesterov=nesterov)


class Reference:
    """The same training with torch's optimizers on whole tensors: torch.optim.Muon on each matrix (the fused
    parameter as its three row blocks, each a leaf of its own), torch.optim.AdamW on the rest."""

    def __init__(self, net: Net, adjust_lr_fn: str = "match_rms_adamw", nesterov: bool = True):
        self.names = [name for name, _ in net.named_parameters()]
        self.full = {name: p.detach().clone() for name, p in net.named_parameters()}
        muon, self.parts = [], {}
        for name in self.names:
            if name.startswith("blocks.") and self.full[name].ndim == 2:
                splits = FUSED_SPLITS if ".fused." in name else (self.full[name].shape[0],)
                self.parts[name] = [t.clone().requires_grad_() for t in self.full[name].split(splits)]
                muon += self.parts[name]
        self.adamw = {n: self.full[n].clone().requires_grad_() for n in self.names if n not in self.parts}
        decay = [t for t in self.adamw.values() if t.ndim == 2]
        no_decay = [t for t in self.adamw.values() if t.ndim != 2]
        self.muon = torch.optim.Muon(muon, lr=LR, weight_decay=MUON_DECAY, adjust_lr_fn=adjust_lr_fn,
                                     nesterov=nesterov)
        self.adam = torch.optim.AdamW([{"params": decay, "weight_decay": ADAMW_DECAY},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS)

    def step(self, grads: dict[str, torch.Tensor], lr: float) -> None:
        for name, grad in grads.items():
            if name in self.parts:
                splits = [t.shape[0] for t in self.parts[name]]
                for t, g in zip(self.parts[name], grad.split(splits), strict=True):
                    t.grad = g.clone()
            else:
                self.adamw[name].grad = grad.clone()
        for opt in (self.muon, self.adam):
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()

    def params(self) -> dict[str, torch.Tensor]:
        return {n: torch.cat([t.detach() for t in self.parts[n]]) if n in self.parts else self.adamw[n].detach()
                for n in self.names}

    def momentum(self, name: str) -> torch.Tensor:
        return torch.cat([self.muon.state[t]["momentum_buffer"] for t in self.parts[name]])


def step_grads(net: Net, step: int) -> dict[str, torch.Tensor]:
    """The full gradients of a step: the same on every rank and world size."""
    gen = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(p.shape, generator=gen) for name, p in net.named_parameters()}


def step_lr(step: int) -> float:
    return LR * (1.0 - 0.2 * step)  # a schedule, set on every group as the training loop does


def set_grads(net: Net, grads: dict[str, torch.Tensor]) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in net.named_parameters():
        g = grads[name]
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g


def train(net: Net, opt: MuonAdamW, steps: range, reference: Reference | None = None) -> None:
    for step in steps:
        grads = step_grads(net, step)
        set_grads(net, grads)
        for group in opt.param_groups:
            group["lr"] = step_lr(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if reference is not None:
            reference.step(grads, step_lr(step))


def full_params(net: Net) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in net.named_parameters()}


def assert_close_to(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The same operations on the same numbers in the same kernels: equal to float rounding."""
    assert actual.keys() == expected.keys()
    for name in actual:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-6, atol=1e-6, msg=name)


# How far a Muon matrix's movement (weights now minus at the start) may be from torch.optim.Muon's, relative to its
# size (Frobenius norms). Both run Newton-Schulz in bf16 (8 bits of mantissa) from the same numbers, but torch
# multiplies each matrix with addmm and MuonAdamW a batch with baddbmm: an fp32 sum added in another order can round
# to the neighbouring bf16 value, and the remaining iterations spread that. Observed here: at most 2.4e-3 (most
# runs: 0). Any systematic error beyond 1% of the update fails; a wrong learning-rate ratio (the other
# adjust_lr_fn) or a fused matrix orthogonalized whole is off by more than 10%.
BF16_NS_RTOL = 1e-2


def movement_error(actual: torch.Tensor, expected: torch.Tensor, start: torch.Tensor) -> float:
    return ((actual - expected).norm() / (expected - start).norm()).item()


def assert_matches_torch(actual: dict[str, torch.Tensor], reference: Reference) -> None:
    expected = reference.params()
    assert actual.keys() == expected.keys()
    for name in actual:
        if name in reference.parts:
            assert movement_error(actual[name], expected[name], reference.full[name]) <= BF16_NS_RTOL, name
        else:  # AdamW's: torch's own kernels on the same numbers
            torch.testing.assert_close(actual[name], expected[name], rtol=1e-6, atol=1e-6, msg=name)


# ---- single process ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_one_process_equals_torch_muon_and_adamw(adjust_lr_fn, nesterov):
    net = make_net()
    start = full_params(net)
    reference = Reference(net, adjust_lr_fn, nesterov)
    other_fn = Reference(net, next(f for f in ("original", "match_rms_adamw") if f != adjust_lr_fn), nesterov)
    opt = make_optimizer(net, adjust_lr_fn, nesterov)
    train(net, opt, range(NUM_STEPS), reference)
    for step in range(NUM_STEPS):
        other_fn.step(step_grads(net, step), step_lr(step))
    assert_matches_torch(full_params(net), reference)
    assert all(not torch.equal(reference.params()[n], start[n]) for n in start)  # no test of untouched weights
    # The tolerance tells a wrong learning-rate ratio apart.
    for name in reference.parts:
        assert movement_error(other_fn.params()[name], reference.params()[name], start[name]) > 10 * BF16_NS_RTOL
    # Each Muon matrix holds one momentum buffer (fp32 elementwise work: the same numbers as torch's), no AdamW moments.
    w = net.blocks[0].fused.weight
    assert set(opt.state[w]) == {"momentum_buffer"}
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], reference.momentum("blocks.0.fused.weight"),
                               rtol=1e-6, atol=1e-7)
    assert opt.orthogonalized_last_step == 2 * MATRICES_PER_BLOCK


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_momentum_is_untouched_by_newton_schulz_in_its_own_dtype(nesterov):
    # With Newton-Schulz in fp32 (the CPU's) the update is the momentum buffer's own dtype, and without Nesterov it is
    # the buffer's value: it must be a copy, since the orthogonalization writes its results over the updates.
    net = make_net()
    reference = Reference(net, nesterov=nesterov)
    param_groups, rows = groups(net)
    opt = MuonAdamW(param_groups, lr=LR, betas=BETAS, row_splits=rows, nesterov=nesterov, ns_dtype=torch.float32)
    train(net, opt, range(NUM_STEPS), reference)
    for name, p in net.named_parameters():
        if name in reference.parts:
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], reference.momentum(name), rtol=1e-6,
                                       atol=1e-7, msg=name)


def test_fused_matrices_are_orthogonalized_one_by_one():
    # Without row_splits the fused parameter is one 9 x 6 matrix: its update differs from that of its three
    # blocks orthogonalized apart, which the reference (and the other test) uses.
    net = make_net()
    reference = Reference(net)
    param_groups, _ = groups(net)
    opt = MuonAdamW(param_groups, lr=LR, betas=BETAS)
    train(net, opt, range(NUM_STEPS), reference)
    actual, expected = full_params(net), reference.params()
    fused, a = "blocks.0.fused.weight", "blocks.0.a.weight"
    assert movement_error(actual[fused], expected[fused], reference.full[fused]) > 10 * BF16_NS_RTOL
    assert movement_error(actual[a], expected[a], reference.full[a]) <= BF16_NS_RTOL


def test_matrices_of_one_shape_are_orthogonalized_in_one_batch(monkeypatch):
    from fsdp_utils.train import muon

    batches = []

    def recording(x, **kwargs):
        batches.append(tuple(x.shape))
        return newton_schulz(x, **kwargs)

    newton_schulz = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", recording)
    net = make_net()
    train(net, make_optimizer(net), range(1))
    # Per block: a and b (7 x 6, transposed to 6 x 7) with c (6 x 7); d (4 x 6); the fused matrix's 5 x 6 and its
    # two 2 x 6. Two blocks: four batches, each holding its shape from both.
    assert sorted(batches) == [(2, 4, 6), (2, 5, 6), (4, 2, 6), (6, 6, 7)]


def test_a_batch_holds_at_most_its_elements_and_splitting_changes_no_result(monkeypatch):
    """NS_BATCH_ELEMENTS bounds the memory of the step's Newton-Schulz (an 8B model's same-shaped matrices in one
    batch would not fit beside it on one GPU); batches of any size give the same matrices as one."""
    from fsdp_utils.train import muon

    batches = []

    def recording(x, **kwargs):
        batches.append(tuple(x.shape))
        return newton_schulz(x, **kwargs)

    newton_schulz = muon.newton_schulz
    key = (5, muon.NS_COEFFICIENTS, 1e-7)
    # Three parameters: one of two 3 x 8 matrices, one 8 x 3 (transposed to 3 x 8), one 5 x 4.
    matrices = [muon._Matrix((6, 8), (3, 3), key, []), muon._Matrix((8, 3), (8,), key, []),
                muon._Matrix((5, 4), (5,), key, [])]
    gen = torch.Generator().manual_seed(0)
    updates = {i: torch.randn(m.shape, generator=gen) for i, m in enumerate(matrices)}
    whole = {i: x.clone() for i, x in updates.items()}
    tensors = dict(whole)
    assert muon._orthogonalize_whole(whole, matrices, batch_elements=10**6) == 4
    assert all(whole[i] is tensors[i] for i in whole)  # in place: the same tensors hold the results
    monkeypatch.setattr(muon, "newton_schulz", recording)
    small = {i: x.clone() for i, x in updates.items()}
    assert muon._orthogonalize_whole(small, matrices, batch_elements=2 * 24) == 4
    assert batches == [(2, 3, 8), (1, 3, 8), (1, 4, 5)]  # two 3 x 8 a batch at most; 5 x 4 transposed
    batches.clear()
    muon._orthogonalize_whole({i: x.clone() for i, x in updates.items()}, matrices, batch_elements=1)
    assert batches == [(1, 3, 8)] * 3 + [(1, 4, 5)]  # a matrix larger than the bound runs alone
    for i in whole:
        torch.testing.assert_close(small[i], whole[i], rtol=0, atol=1e-6)
        assert not torch.equal(whole[i], updates[i])  # in place: the updates themselves were replaced


def test_state_dict_round_trip_continues_the_same():
    net, other = make_net(), make_net()
    opt = make_optimizer(net)
    train(net, opt, range(2))
    other.load_state_dict(net.state_dict())
    resumed = make_optimizer(other)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load keeps the tensors it is given
    train(net, opt, range(2, 4))
    train(other, resumed, range(2, 4))
    assert_close_to(full_params(other), full_params(net))


def test_a_plain_adamw_state_is_refused():
    net = make_net()
    adamw = torch.optim.AdamW(net.parameters())
    opt = make_optimizer(net)
    with pytest.raises(ValueError, match="saved under another train.optimizer"):
        opt.load_state_dict(adamw.state_dict())


def test_bad_groups_are_refused():
    net = make_net()
    with pytest.raises(ValueError, match="use_muon"):
        MuonAdamW([{"params": net.output.parameters()}], lr=LR)
    with pytest.raises(ValueError, match=r"shape \(6,\)"):
        MuonAdamW([{"params": [net.blocks[0].norm.weight], "use_muon": True}], lr=LR)
    with pytest.raises(ValueError, match="do not add up"):
        MuonAdamW([{"params": [net.blocks[0].a.weight], "use_muon": True}], lr=LR,
                  row_splits={net.blocks[0].a.weight: (3, 3)})


def test_split_parameters_of_our_transformer():
    from model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
    model = Transformer(cfg)
    split = split_parameters(model, model.layers)
    names = {id(p): n for n, p in model.named_parameters()}
    # Muon: the four projection weights of each block; AdamW: embedding, norms, output.
    assert sorted(names[id(p)] for p in split.matrices) == sorted(
        f"layers.{i}.{w}.weight" for i in range(2)
        for w in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2"))
    assert {names[id(p)] for p in split.others} == {n for n, _ in model.named_parameters()} - {
        names[id(p)] for p in split.matrices}
    # wqkv: 4 heads of 8 for q, 2 kv heads of 8 each for k and v; w13: gate and up of hidden_dim each.
    head_dim = cfg.dim // cfg.n_heads
    splits = fused_row_splits(model.layers)
    assert splits[model.layers[0].attention.wqkv.weight] == (4 * head_dim, 2 * head_dim, 2 * head_dim)
    assert splits[model.layers[1].feed_forward.w13.weight] == (cfg.hidden_dim, cfg.hidden_dim)
    assert split.row_splits == splits


def test_chunk_rows_follows_torch_chunk():
    for rows in (1, 4, 5, 7, 9, 16):
        for n in (1, 2, 3, 4):
            # torch.chunk may return fewer than n chunks; the ranks past them hold nothing.
            expected = [len(c) for c in torch.arange(rows).chunk(n)]
            assert chunk_rows(rows, n) == expected + [0] * (n - len(expected))


# ---- several ranks ----------------------------------------------------------------------------------------------


def sharded_net(mesh_shape: tuple[int, ...]) -> tuple[Net, Reference, MuonAdamW]:
    """make_net's model sharded by FSDP2 (each block, then the root) on a (shard,) or (replicate, shard) mesh, the
    reference from its weights before sharding, and its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    net = make_net()
    reference = Reference(net)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, reference, make_optimizer(net)


def sharded_training(rank: int, world_size: int, mesh_shape: tuple[int, ...],
                     batch_elements: int | None = None) -> dict:
    from fsdp_utils.train import muon

    if batch_elements is not None:  # this rank's process only: every Newton-Schulz batch this small
        muon.NS_BATCH_ELEMENTS = batch_elements
    net, reference, opt = sharded_net(mesh_shape)
    train(net, opt, range(NUM_STEPS), reference)
    unsharded = make_net()
    train(unsharded, make_optimizer(unsharded), range(NUM_STEPS))
    sharded = full_params(net)
    assert_matches_torch(sharded, reference)
    # Sharding adds nothing: the same numbers as one process's MuonAdamW (the same kernels on the same matrices).
    assert_close_to(sharded, full_params(unsharded))
    w = net.blocks[1].fused.weight
    torch.testing.assert_close(opt.state[w]["momentum_buffer"].full_tensor(),
                               reference.momentum("blocks.1.fused.weight"), rtol=1e-6, atol=1e-7)
    return {"local_rows": w.to_local().shape[0], "orthogonalized": opt.orthogonalized_last_step}


@pytest.mark.slow  # spawns gloo ranks
@pytest.mark.parametrize(("world_size", "batch_elements"), [(2, None), (3, None), (2, 1)])
def test_fsdp2_sharded_equals_torch_reference(world_size, batch_elements):
    # batch_elements=1: each matrix a Newton-Schulz batch of its own, written back into its owner's whole matrices.
    from tests.distributed_harness import run_ranks

    ranks = run_ranks(sharded_training, world_size=world_size, mesh_shape=(world_size,), batch_elements=batch_elements)
    # The momentum stays sharded: each rank holds its chunk of the fused matrix's 9 rows.
    assert [r["local_rows"] for r in ranks] == chunk_rows(9, world_size)
    # Each matrix is orthogonalized by one rank, and the work is split: no rank does all of them.
    done = [r["orthogonalized"] for r in ranks]
    assert sum(done) == 2 * MATRICES_PER_BLOCK and max(done) < 2 * MATRICES_PER_BLOCK, done


@pytest.mark.slow  # spawns four gloo ranks
def test_hsdp_mesh_equals_torch_reference():
    from tests.distributed_harness import run_ranks

    ranks = run_ranks(sharded_training, world_size=4, mesh_shape=(2, 2))
    # Each replica splits the matrices between its two shards.
    done = [r["orthogonalized"] for r in ranks]
    assert done[0] + done[1] == done[2] + done[3] == 2 * MATRICES_PER_BLOCK, done
    assert max(done) < 2 * MATRICES_PER_BLOCK, done


def checkpointed_training(rank: int, world_size: int, path: str, save: bool, full: bool) -> None:
    """At `save`: NUM_STEPS steps, then a save: DCP's sharded one, or (`full`) the full state dicts gathered to rank 0
    in one file. Otherwise: a fresh model and optimizer loaded from it (resharded to this world size), one more step,
    compared with the reference's uninterrupted NUM_STEPS + 1 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    net, reference, opt = sharded_net((world_size,))
    options = StateDictOptions(full_state_dict=full)
    if save:
        train(net, opt, range(NUM_STEPS))
        model_sd, optim_sd = get_state_dict(net, opt, options=options)
        if not full:
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
        elif rank == 0:
            torch.save({"model": model_sd, "optimizer": optim_sd}, path)
        return
    if full:
        state = torch.load(path, weights_only=True)
    else:
        model_sd, optim_sd = get_state_dict(net, opt, options=options)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=path)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options)
    train(net, opt, range(NUM_STEPS, NUM_STEPS + 1))
    for step in range(NUM_STEPS + 1):
        reference.step(step_grads(net, step), step_lr(step))
    assert_matches_torch(full_params(net), reference)
    torch.testing.assert_close(opt.state[net.blocks[0].fused.weight]["momentum_buffer"].full_tensor(),
                               reference.momentum("blocks.0.fused.weight"), rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # spawns gloo ranks
@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_a_save_at_two_ranks_resumes_at_three_as_uninterrupted(tmp_path, full):
    from tests.distributed_harness import run_ranks

    path = str(tmp_path / "checkpoint")
    run_ranks(checkpointed_training, world_size=2, path=path, save=True, full=full)
    run_ranks(checkpointed_training, world_size=3, path=path, save=False, full=full)


def test_fsdp1_is_named_as_the_problem():
    # The run's FSDP adapter says whether each parameter is a matrix of its own (tests/test_fsdp_adapter.py checks
    # that against real wraps); FSDP1's flat parameters are not.
    from config import FSDPConfig
    from fsdp_utils.distributed import DistEnv
    from fsdp_utils.parallel.fsdp import fsdp_adapter

    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    fsdp1, fsdp2 = (fsdp_adapter(FSDPConfig(version=version), env) for version in (1, 2))
    assert sharding_problem(fsdp1) == FSDP1_PROBLEM
    assert "fsdp.version: 2" in FSDP1_PROBLEM
    assert sharding_problem(fsdp2, make_net().parameters()) is not None  # 1-D biases are no matrices
    net = make_net()
    assert sharding_problem(fsdp2, split_parameters(net, net.blocks).matrices) is None


# ---- train.optimizer=muon in the run --------------------------------------------------------------------------


def test_build_optimizer_gives_muon_the_block_matrices_and_adamw_the_rest_with_one_decay_rule():
    from config import FSDPConfig
    from fsdp_utils.distributed import DistEnv
    from fsdp_utils.parallel.fsdp import fsdp_adapter
    from fsdp_utils.train.optim import MuonSettings, build_optimizer, decay_split
    from model import ModelConfig, Transformer

    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16))
    names = {id(p): n for n, p in model.named_parameters()}
    settings = MuonSettings(list(model.layers), fsdp_adapter(FSDPConfig(version=2), env), momentum=0.9, ns_steps=4,
                            ns_dtype=torch.float32)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=False, muon=settings)
    assert isinstance(optimizer, MuonAdamW) and optimizer.ns_dtype == torch.float32
    groups = [(g["use_muon"], g["weight_decay"], sorted(names[id(p)] for p in g["params"]))
              for g in optimizer.param_groups]
    muon = sorted(f"layers.{i}.{w}.weight" for i in range(2)
                  for w in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2"))
    # AdamW's share split as train.optimizer=adamw splits it: the embedding and the output projection decay, norms
    # do not.
    decay, no_decay = decay_split(model)
    assert groups == [(True, 0.1, muon),
                      (False, 0.1, sorted(names[id(p)] for p in decay if names[id(p)] not in muon)),
                      (False, 0.0, sorted(names[id(p)] for p in no_decay))]
    assert groups[1][2] == ["output.weight", "tok_embeddings.weight"]
    assert all(n.endswith("norm.weight") for n in groups[2][2])
    assert optimizer.param_groups[0]["momentum"] == 0.9 and optimizer.param_groups[0]["ns_steps"] == 4
    adamw = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=False)
    assert [sorted(names[id(p)] for p in g["params"]) for g in adamw.param_groups] == [
        sorted(names[id(p)] for p in decay), groups[2][2]]
    # FSDP1's flat parameters are refused, in the config's words.
    fsdp1 = MuonSettings(list(model.layers), fsdp_adapter(FSDPConfig(version=1), env))
    with pytest.raises(ValueError, match="fsdp.version: 2"):
        build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), muon=fsdp1)


@pytest.mark.parametrize(("overrides", "line"), [
    (["--fsdp.version=1"], FSDP1_PROBLEM),
    (["--fsdp.version=2", "--train.lora.rank=4"],
     "train.optimizer=muon cannot train train.lora's adapters (their low-rank factors are no weight matrices Muon is "
     "made for): LoRA trains with train.optimizer: adamw"),
    (["--fsdp.version=2", "--train.muon_momentum=1"], "train.muon_momentum must be in [0, 1), got 1.0"),
    (["--fsdp.version=2", "--train.muon_ns_steps=0"], "train.muon_ns_steps must be positive, got 0"),
])
def test_muon_config_errors_are_one_line_each(overrides, line):
    from config import ConfigError, load_config
    from tests.helpers import ROOT

    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "config/train_tiny_fsdp.yaml", ["--train.optimizer=muon", *overrides])
    assert err.value.problems == [line]


@pytest.mark.slow  # launches training jobs
def test_muon_trains_the_tiny_config_alike_on_one_two_and_three_ranks(tmp_path, corpus, dataset_dir):
    """The same global batches (12 sequences: 1, 2 or 3 ranks of micro-batches of 2) give the same losses to float
    rounding: the sharded Newton-Schulz exchange computes what one process computes (fp32 on the CPU)."""
    import math

    from tests.helpers import losses, run_train

    args = ("--train.max_steps=6", "--train.global_batch_size=12", "--fsdp.version=2", "--train.optimizer=muon")
    got = {}
    for nproc in (1, 2, 3):
        proc = run_train(*args, nproc=nproc, out_dir=tmp_path / f"ranks{nproc}", corpus=corpus,
                         dataset_dir=dataset_dir)
        assert "optimizer muon" in proc.stderr
        got[nproc] = losses(tmp_path / f"ranks{nproc}")
    assert sorted(got[1]) == list(range(1, 7))
    assert got[1][6] < got[1][1] - 1.0, got[1]  # it trains
    for nproc in (2, 3):
        for step, loss in got[1].items():
            assert math.isclose(got[nproc][step], loss, rel_tol=2e-6), (nproc, step, got[nproc][step], loss)


@pytest.mark.slow  # launches the benchmark at 2 ranks
def test_the_benchmark_times_the_optimizer_step_and_weighs_its_state_for_adamw_and_muon(tmp_path):
    import json

    from model import ModelConfig, Transformer
    from tests.helpers import ROOT, job_env, run_job

    dims = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    argv = [str(ROOT / "benchmarks/benchmark.py"), str(ROOT / "config/train_tiny_fsdp.yaml"), "--muon", "--steps=3",
            "--warmup=1", f"--json={tmp_path / 'bench.jsonl'}", "--run.device=cpu", "--fsdp.version=2",
            *(f"--model.{k}={v}" for k, v in dims.items()), "--data.seq_len=32", "--data.vocab_size=320",
            "--train.micro_batch_size=2", "--train.global_batch_size=4"]
    proc = run_job(argv, nproc=2, env=job_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("run "))
    assert "optim ms" in header and "optim GiB" in header
    rows = {r["name"]: r for r in json.loads((tmp_path / "bench.jsonl").read_text())["rows"]}
    assert set(rows) == {"ours", "ours_muon"}
    for r in rows.values():
        assert 0 < r["optim_step_s"] < r["step_s"]
    # Muon keeps one buffer per block matrix where AdamW keeps two moments; both keep two for the rest.
    model = Transformer(ModelConfig(vocab_size=320, tie_embeddings=True, **dims))  # as the tiny config
    matrices = sum(p.numel() for p in split_parameters(model, model.layers).matrices)
    share = matrices / sum(p.numel() for p in model.parameters())
    ratio = rows["ours_muon"]["optim_state_gib"] / rows["ours"]["optim_state_gib"]
    assert ratio == pytest.approx(1 - share / 2, rel=0.03), (ratio, share)


def test_bench_muon_counts_the_configs_matrices_and_times_each_way(capsys):
    from benchmarks.bench_muon import main

    assert main(["config/train_tiny_fsdp.yaml", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # 4 blocks of wqkv (q, k, v), wo, w13 (gate, up) and w2: 16 parameters holding 28 matrices
    assert lines[0].startswith("config/train_tiny_fsdp.yaml: 16 parameters, 28 matrices")
    ways = ("batched", "by_shape", "per_parameter", "per_matrix")
    assert [line.split()[:2] for line in lines[1:]] == [[d, way] for d in ("bfloat16", "float32") for way in ways]
