"""Muon for the blocks' weight matrices and AdamW for every other parameter, in one optimizer that stays correct
when FSDP2 shards the parameters.

Muon (Keller Jordan's, as torch.optim.Muon computes it): a momentum buffer per matrix, the Nesterov update
orthogonalized by five Newton-Schulz iterations in bf16, decoupled weight decay, and a learning rate scaled per
matrix shape (`match_rms_adamw`: 0.2 * sqrt(max(rows, cols)), which gives the update AdamW's RMS so that one
`lr` and one schedule serve both kinds of parameters; `original`: sqrt(max(1, rows / cols))).

Under FSDP2 every parameter is a DTensor sharded by rows (torch.chunk semantics: the last ranks' shards may be
smaller or empty), on a 1-D mesh or on the shard dimension of a (replicate, shard) mesh. The momentum stays
sharded like the parameter; only the step's update travels. Newton-Schulz needs whole matrices, so each matrix is
given to one rank of its shard group (balanced by the work of its iterations): one all_to_all_single sends every
rank's rows of each matrix to its owner, the owner orthogonalizes all its matrices batched by shape (bmm chains of
up to NS_BATCH_ELEMENTS elements, tall matrices transposed so that (d, 4d) and (4d, d) share a batch), and a second
all_to_all_single sends each rank its rows of the results. Two collectives a step per shard group, whatever the
number of matrices.
The rows travel in bf16 (torch's Newton-Schulz starts by casting to bf16, so nothing is lost) on the mesh's device,
with FSDP2's CPU offload too. gloo and NCCL both implement all_to_all_single with uneven splits, which uneven
shards need; gloo's list all_to_all does not.
Across the replicas of HSDP every replica computes the same results from the same reduced gradients; matrices
that no rank shards (one process, or FSDP2's NO_SHARD) are orthogonalized where they are.

A parameter that stacks several matrices by rows (our blocks' wqkv holds q, k and v, w13 the gate and up
projections) is orthogonalized matrix by matrix (`row_splits`), each with the learning rate of its own shape.

Design: one torch.optim.Optimizer subclass whose parameter groups carry `use_muon`, not a container of two
optimizers. The training loop, GradScaler (`unscale_`, `step`), the FP8 converters' step hooks and
torch.distributed.checkpoint's get_state_dict / set_state_dict all take one torch Optimizer, and the loop sets
`group["lr"]` on every group of `optimizer.param_groups`: with one optimizer nothing of that changes. The AdamW
groups are stepped by a torch.optim.AdamW that shares this optimizer's group dicts and state (bound again before
every step, so a load_state_dict, which replaces both, cannot leave it stale): torch's own math, fused or foreach
kernels included, and its state (step, exp_avg, exp_avg_sq) saved and loaded exactly as a plain AdamW's. Muon's
state is one `momentum_buffer` per matrix, a DTensor like its parameter, so DCP saves it sharded and a resume at
another world size reshards it; the optimizer holds half of AdamW's state for the Muon matrices.

FSDP1 flattens each unit's parameters into one 1-D shard, so no rank holds a matrix's rows: `sharding_problem`
says so (FSDP1_PROBLEM, from the run's FSDP adapter), and the optimizer refuses such parameters.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from config.checks import MUON_FSDP1_PROBLEM
from model.transformer import Attention, FeedForward

from ..parallel.fsdp import FSDPAdapter

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's (a, b, c) as Muon publishes them
# The most elements one Newton-Schulz batch stacks (1 GiB in bf16): a batch holds three tensors of its size and two
# Gram matrices at once, so all of an 8B model's same-shaped matrices in one batch (10.5 GiB each) would not fit
# beside the model on one GPU; batches of a few large matrices lose little against one (benchmarks/bench_muon.py).
NS_BATCH_ELEMENTS = 1 << 29
ADJUST_LR_FNS = ("original", "match_rms_adamw")
FSDP1_PROBLEM = MUON_FSDP1_PROBLEM  # the config's check says it first

# Muon's hyperparameters, filled into every group with use_muon True that does not set its own.
MUON_KEYS = ("momentum", "nesterov", "ns_steps", "ns_coefficients", "eps", "adjust_lr_fn")


def newton_schulz(x: torch.Tensor, *, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7) -> torch.Tensor:
    """Orthogonalize a batch of matrices x (b, m, n) with m <= n, in x's dtype: scaled to unit Frobenius norm,
    then `steps` iterations of X <- a X + (b G + c G G) X with G = X X^T (b, m, m). Returns a new tensor;
    its buffers are allocated once and reused by every iteration."""
    a, b, c = coefficients
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    gram = x.new_empty(x.shape[0], x.shape[1], x.shape[1])  # (b, m, m)
    poly = torch.empty_like(gram)
    out = torch.empty_like(x)
    for _ in range(steps):
        torch.bmm(x, x.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        torch.baddbmm(x, poly, x, beta=a, out=out)
        x, out = out, x
    return x


def lr_ratio(shape: tuple[int, int], adjust_lr_fn: str) -> float:
    """The factor on the learning rate of a matrix of `shape` (rows, cols); see the module docstring."""
    rows, cols = shape
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def fused_row_splits(blocks: Iterable[nn.Module]) -> dict[torch.Tensor, tuple[int, ...]]:
    """The fused weights of our blocks, each with its matrices' row counts: wqkv (q, k, v) and w13 (gate, up).
    Empty for blocks of another shape (a Hugging Face layer has one parameter per projection)."""
    splits: dict[torch.Tensor, tuple[int, ...]] = {}
    for block in blocks:
        for module in block.modules():
            if isinstance(module, Attention):
                q, kv = module.n_heads * module.head_dim, module.n_kv_heads * module.head_dim
                splits[module.wqkv.weight] = (q, kv, kv)
            elif isinstance(module, FeedForward):
                splits[module.w13.weight] = (module.hidden_dim, module.hidden_dim)
    return splits


@dataclass
class MuonSplit:
    """A model's trainable parameters as train.optimizer=muon divides them."""
    matrices: list[nn.Parameter]  # Muon's: the weights of the blocks' linear layers
    others: list[nn.Parameter]  # AdamW's: embedding, output projection, norms, biases
    row_splits: dict[torch.Tensor, tuple[int, ...]] = field(default_factory=dict)  # MuonAdamW's row_splits


def split_parameters(model: nn.Module, blocks: Iterable[nn.Module]) -> MuonSplit:
    """Muon takes the weight of every nn.Linear inside `blocks` (the attention and feed-forward projections; FP8
    linear layers are nn.Linear too); AdamW everything else. Goes by module, not by `ndim`: the embedding and
    the output projection are matrices that Muon must not take."""
    blocks = list(blocks)
    in_blocks = {id(p) for block in blocks for m in block.modules() if isinstance(m, nn.Linear)
                 for name, p in m.named_parameters(recurse=False) if name == "weight"}
    split = MuonSplit([], [], {})
    seen: set[int] = set()
    for param in model.parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            (split.matrices if id(param) in in_blocks else split.others).append(param)
    split.row_splits = {p: rows for p, rows in fused_row_splits(blocks).items() if p.requires_grad}
    return split


def _shard_dim(param: torch.Tensor) -> int | None:
    """The mesh dimension over which a DTensor's rows are sharded; None when every rank holds them all.
    ValueError for a layout Muon cannot gather (sharded by columns, sharded twice, partial sums)."""
    if not isinstance(param, DTensor):
        return None
    sharded = [i for i, p in enumerate(param.placements) if not p.is_replicate()]
    by_rows = [i for i in sharded if type(param.placements[i]) is Shard and param.placements[i].is_shard(dim=0)]
    if len(sharded) > 1 or by_rows != sharded:
        raise ValueError(f"a Muon matrix of shape {tuple(param.shape)} has placements {param.placements}: only "
                         "rows sharded over one mesh dimension (FSDP2's Shard(0)) are supported")
    return sharded[0] if sharded else None


def chunk_rows(rows: int, num_ranks: int) -> list[int]:
    """Each rank's row count under torch.chunk semantics (FSDP2's and DTensor's Shard(0)): ceil(rows / n) each,
    the last ranks' shards smaller or empty."""
    size = -(-rows // num_ranks)
    return [max(0, min(size, rows - r * size)) for r in range(num_ranks)]


def sharding_problem(fsdp: FSDPAdapter, matrices: Iterable[torch.Tensor] = ()) -> str | None:
    """Why Muon cannot run on these matrices of a model sharded by `fsdp` (FSDP1, a parameter that is not a matrix,
    a layout other than rows sharded over one mesh dimension); None when it can."""
    if not fsdp.per_matrix:
        return FSDP1_PROBLEM
    return next((problem for problem in map(_matrix_problem, matrices) if problem is not None), None)


def _matrix_problem(param: torch.Tensor) -> str | None:
    if param.ndim != 2:
        return f"Muon orthogonalizes matrices, and a parameter of shape {tuple(param.shape)} is none"
    try:
        _shard_dim(param)
    except ValueError as err:
        return str(err)
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Matrix:
    """One Muon parameter as a step sees it: its global shape, the matrices stacked in it (row counts), and
    for each a slice of this rank's local rows with its learning-rate factor."""
    shape: tuple[int, int]
    splits: tuple[int, ...]
    ns_key: tuple  # (ns_steps, ns_coefficients, eps): matrices batched together share it
    local_slices: list[tuple[int, int, float]]  # (start, stop, lr ratio) in local rows


@dataclass
class _Exchange:
    """The matrices of one shard group and who orthogonalizes each. members: indices into the step's matrices,
    ordered by owner; `rows[i][k]`: rank k's rows of matrix i."""
    group: Any  # the shard dimension's ProcessGroup; None: each rank holds its matrices whole
    device: torch.device  # where the group communicates and its owners orthogonalize
    rank: int
    size: int
    members: list[int]
    owners: dict[int, int]
    rows: dict[int, list[int]]
    send_splits: list[int] = field(default_factory=list)  # elements this rank sends to each rank
    recv_splits: list[int] = field(default_factory=list)  # elements it receives from each

    @property
    def mine(self) -> list[int]:
        return [i for i in self.members if self.owners[i] == self.rank]


def _ns_cost(shape: tuple[int, int], splits: tuple[int, ...]) -> int:
    """Newton-Schulz's work on a parameter, up to a constant: m * m * n per matrix of m <= n."""
    cols = shape[1]
    return sum(min(r, cols) ** 2 * max(r, cols) for r in splits)


def assign_owners(parameters: Sequence[tuple[tuple[int, int], tuple[int, ...]]], size: int) -> list[int]:
    """The rank of `size` that orthogonalizes each parameter ((rows, cols), the row counts of its matrices):
    longest work first onto the least loaded rank, ties to the earlier parameter and the lower rank. It depends
    only on the shapes and their order, so every rank computes the same (and the planner the same as a run)."""
    costs = [_ns_cost(shape, splits) for shape, splits in parameters]
    loads = [0] * size
    owners = [0] * len(parameters)
    for j in sorted(range(len(parameters)), key=lambda j: (-costs[j], j)):
        owners[j] = min(range(size), key=lambda r: (loads[r], r))
        loads[owners[j]] += costs[j]
    return owners


def _plan_exchange(members: list[int], matrices: list[_Matrix], *, group: Any, device: torch.device, rank: int,
                   size: int) -> _Exchange:
    """Owners by assign_owners (members are in ascending order), then the all_to_all splits."""
    owners = dict(zip(members, assign_owners([(matrices[i].shape, matrices[i].splits) for i in members], size),
                      strict=True))
    ordered = sorted(members, key=lambda i: (owners[i], i))
    rows = {i: chunk_rows(matrices[i].shape[0], size) for i in members}
    ex = _Exchange(group, device, rank, size, ordered, owners, rows)
    ex.send_splits = [sum(rows[i][rank] * matrices[i].shape[1] for i in ordered if owners[i] == k)
                      for k in range(size)]
    ex.recv_splits = [sum(rows[i][k] * matrices[i].shape[1] for i in ex.mine) for k in range(size)]
    return ex


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups with `use_muon: True` (matrices), AdamW (torch's) on the others; see the module
    docstring. Each group is a dict with "params" and "use_muon", and may set its own "lr", "weight_decay" and
    the hyperparameters of its kind; the keyword arguments are the defaults. `row_splits`: parameters that stack
    several matrices by rows, with their row counts (fused_row_splits)."""

    def __init__(self, param_groups: Iterable[dict[str, Any]], *, lr: float, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = 1e-7,
                 adjust_lr_fn: str = "match_rms_adamw", betas: tuple[float, float] = (0.9, 0.999),
                 adamw_eps: float = 1e-8, fused: bool | None = None, foreach: bool | None = None,
                 row_splits: Mapping[torch.Tensor, Sequence[int]] | None = None,
                 ns_dtype: torch.dtype = torch.bfloat16):
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: expected one of {', '.join(ADJUST_LR_FNS)}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon's momentum {momentum} is not in [0, 1)")
        self._muon_defaults = dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                   ns_coefficients=tuple(ns_coefficients), eps=eps, adjust_lr_fn=adjust_lr_fn)
        self._row_splits = {id(p): tuple(rows) for p, rows in (row_splits or {}).items()}
        self.ns_dtype = ns_dtype
        self._plan_key: tuple | None = None
        self._cached_plan: tuple[list[_Matrix], list[_Exchange]] | None = None
        self.orthogonalized_last_step = 0  # matrices this rank ran Newton-Schulz on at its last step
        super().__init__(list(param_groups), dict(lr=lr, weight_decay=weight_decay))
        adamw_groups = [g for g in self.param_groups if not g["use_muon"]]
        # Shares the group dicts: AdamW fills its own keys into them (betas, eps, fused, ...).
        self._adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=adamw_eps, weight_decay=weight_decay,
                                        fused=fused, foreach=foreach) if adamw_groups else None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group.get("use_muon"), bool):
            raise ValueError("every parameter group of MuonAdamW says use_muon: True or False")
        if param_group["use_muon"]:
            for key, value in self._muon_defaults.items():
                param_group.setdefault(key, value)
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            for p in params:
                problem = _matrix_problem(p)
                if problem is not None:
                    raise ValueError(problem)
                rows = self._row_splits.get(id(p), (p.shape[0],))
                if sum(rows) != p.shape[0]:
                    raise ValueError(f"row_splits {rows} do not add up to the {p.shape[0]} rows of a Muon matrix")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, after checking that the saved groups are the same kinds (Muon or AdamW) as these."""
        saved = [g.get("use_muon") for g in state_dict["param_groups"]]
        here = [g["use_muon"] for g in self.param_groups]
        if saved != here:
            kinds = lambda flags: "/".join({True: "muon", False: "adamw"}.get(f, "adamw") for f in flags)  # noqa: E731
            raise ValueError(f"the optimizer state was saved with parameter groups {kinds(saved)}, this optimizer "
                             f"has {kinds(here)}: saved under another train.optimizer")
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        adamw_groups = [g for g in self.param_groups if not g["use_muon"]]
        if adamw_groups:
            assert self._adamw is not None, "groups keep their kind (load_state_dict checks)"
            self._adamw.param_groups = adamw_groups  # bound anew: load_state_dict replaces groups and state
            self._adamw.state = self.state
            self._adamw.step()
        self._muon_step()
        return loss

    def _muon_step(self) -> None:
        groups = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups if g["use_muon"]]
        groups = [(g, params) for g, params in groups if params]
        if not groups:
            self.orthogonalized_last_step = 0
            return
        updates: list[torch.Tensor] = []
        for group, ps in groups:
            updates += self._momentum_update(group, ps)
        matrices, exchanges = self._plan(groups)
        results = self._orthogonalize(updates, matrices, exchanges)
        start = 0
        for group, ps in groups:
            lr, count = float(group["lr"]), len(ps)
            locals_ = [_local(p) for p in ps]
            torch._foreach_mul_(locals_, 1.0 - lr * group["weight_decay"])
            by_alpha: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for p, i in zip(locals_, range(start, start + count), strict=True):
                for lo, hi, ratio in matrices[i].local_slices:
                    targets, sources = by_alpha.setdefault(-lr * ratio, ([], []))
                    targets.append(p[lo:hi])
                    sources.append(results[i][lo:hi])
            for alpha, (targets, sources) in by_alpha.items():
                torch._foreach_add_(targets, sources, alpha=alpha)
            start += count

    def _momentum_update(self, group: dict[str, Any], params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Update the momentum buffers (local shards) and return the local rows of each update to orthogonalize, in the
        Newton-Schulz dtype."""
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)  # a DTensor like p: saved sharded
            bufs.append(_local(state["momentum_buffer"]))
        grads = [_local(p.grad) for p in params]  # type: ignore[arg-type]
        momentum = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1.0 - momentum)  # buf <- momentum * buf + (1 - momentum) * grad
        # Nesterov: grad + momentum * (buf - grad). Rounded to the Newton-Schulz dtype one matrix at a time, so that
        # no full-precision copy of every update is held at once.
        if group["nesterov"]:
            return [torch.lerp(g, b, momentum).to(self.ns_dtype) for g, b in zip(grads, bufs, strict=True)]
        # A copy even in the buffer's own dtype: the orthogonalization writes its results over the updates.
        return [b.to(self.ns_dtype, copy=True) for b in bufs]

    def _plan(self, groups: list[tuple[dict[str, Any], list[torch.Tensor]]]) -> tuple[list[_Matrix], list[_Exchange]]:
        """The step's matrices and exchanges, cached by the parameters with gradients and their settings."""
        key = tuple((id(p), g["ns_steps"], tuple(g["ns_coefficients"]), g["eps"], g["adjust_lr_fn"])
                    for g, ps in groups for p in ps)
        if self._plan_key != key:
            self._plan_key, self._cached_plan = key, self._make_plan(groups)
        assert self._cached_plan is not None
        return self._cached_plan

    def _make_plan(self, groups: list[tuple[dict[str, Any], list[torch.Tensor]]]) -> tuple[list[_Matrix],
                                                                                            list[_Exchange]]:
        matrices: list[_Matrix] = []
        by_group: dict[tuple[Any, torch.device], list[int]] = {}
        where: dict[tuple[Any, torch.device], tuple[int, int]] = {}
        for g, ps in groups:
            for p in ps:
                shape = (p.shape[0], p.shape[1])
                splits = self._row_splits.get(id(p), (shape[0],))
                dim = _shard_dim(p)
                group, rank, size = None, 0, 1
                device = _mesh_device(p.device_mesh.device_type) if isinstance(p, DTensor) else p.device
                if dim is not None and p.device_mesh.size(dim) > 1:  # type: ignore[attr-defined]
                    mesh = p.device_mesh  # type: ignore[attr-defined]
                    group, rank, size = mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim)
                rows = chunk_rows(shape[0], size)
                if _local(p).shape[0] != rows[rank]:
                    raise ValueError(f"a Muon matrix of shape {shape} holds {_local(p).shape[0]} rows on this rank, "
                                     f"torch.chunk semantics give {rows[rank]}")
                offset = sum(rows[:rank])
                matrices.append(_Matrix(shape, splits, (g["ns_steps"], tuple(g["ns_coefficients"]), g["eps"]),
                                        _local_slices(splits, offset, rows[rank], shape[1], g["adjust_lr_fn"])))
                by_group.setdefault((group, device), []).append(len(matrices) - 1)
                where[group, device] = (rank, size)
        exchanges = [_plan_exchange(members, matrices, group=group, device=device, rank=where[group, device][0],
                                    size=where[group, device][1]) for (group, device), members in by_group.items()]
        return matrices, exchanges

    def _orthogonalize(self, updates: list[torch.Tensor], matrices: list[_Matrix],
                       exchanges: list[_Exchange]) -> list[torch.Tensor]:
        """Each rank's rows of every matrix's orthogonalized update, in the Newton-Schulz dtype."""
        results: list[torch.Tensor] = [torch.empty(0)] * len(updates)
        whole: dict[int, torch.Tensor] = {}
        gathers = [_gather(ex, updates, matrices) for ex in exchanges]  # all in flight, then waited
        while gathers:  # each exchange's buffers go as it is read, before Newton-Schulz needs memory of its own
            whole.update(gathers.pop(0)())
        self.orthogonalized_last_step = _orthogonalize_whole(whole, matrices)
        scattered = [_scatter(ex, whole, matrices, home=updates[0]) for ex in exchanges]
        for finish in scattered:
            results_of = finish()
            for i, value in results_of.items():
                results[i] = value
        return results


def _local_slices(splits: tuple[int, ...], offset: int, num_rows: int, cols: int,
                  adjust_lr_fn: str) -> list[tuple[int, int, float]]:
    """For rows [offset, offset + num_rows) of a parameter stacking matrices of `splits` rows: the local row
    slice of each matrix it meets, with that matrix's learning-rate factor."""
    slices, start = [], 0
    for rows in splits:
        lo, hi = max(start, offset), min(start + rows, offset + num_rows)
        if lo < hi:
            slices.append((lo - offset, hi - offset, lr_ratio((rows, cols), adjust_lr_fn)))
        start += rows
    return slices


def _gather(ex: _Exchange, updates: list[torch.Tensor], matrices: list[_Matrix]):
    """Start sending every rank's rows of each matrix to its owner; returns the wait, which gives the owner's
    whole matrices by index."""
    if ex.group is None:
        return lambda: {i: updates[i].to(ex.device) for i in ex.members}
    send = torch.cat([updates[i].reshape(-1) for i in ex.members]).to(ex.device)
    recv = send.new_empty(sum(ex.recv_splits))
    work = dist.all_to_all_single(recv, send, ex.recv_splits, ex.send_splits, group=ex.group, async_op=True)

    def finish() -> dict[int, torch.Tensor]:
        assert work is not None and send.numel() == sum(ex.send_splits)  # send: alive until the exchange is done
        work.wait()
        mine = ex.mine
        # From each source rank k: its rows of each matrix this rank owns, in the exchange's order.
        pieces = [chunk.split([ex.rows[i][k] * matrices[i].shape[1] for i in mine])
                  for k, chunk in enumerate(recv.split(ex.recv_splits))]
        return {i: torch.cat([pieces[k][j].view(-1, matrices[i].shape[1]) for k in range(ex.size)])
                for j, i in enumerate(mine)}

    return finish


def _scatter(ex: _Exchange, whole: dict[int, torch.Tensor], matrices: list[_Matrix], *, home: torch.Tensor):
    """Start sending each rank its rows of the matrices this rank orthogonalized; returns the wait, which gives
    this rank's rows of every matrix of the exchange by index, on the device and in the dtype of `home`."""
    if ex.group is None:
        return lambda: {i: whole[i].to(home.device) for i in ex.members}
    mine = ex.mine
    starts = {i: [0, *itertools.accumulate(ex.rows[i])] for i in mine}
    send_parts = [whole[i][starts[i][k]:starts[i][k + 1]].reshape(-1) for k in range(ex.size) for i in mine]
    empty = home.new_empty(0).to(ex.device)
    send = torch.cat(send_parts) if send_parts else empty  # empty: this rank owns no matrix
    recv = empty.new_empty(sum(ex.send_splits))
    work = dist.all_to_all_single(recv, send, ex.send_splits, ex.recv_splits, group=ex.group, async_op=True)

    def finish() -> dict[int, torch.Tensor]:
        assert work is not None and send.numel() == sum(ex.recv_splits)  # send: alive until the exchange is done
        work.wait()
        # From each owner: this rank's rows of its matrices, in the exchange's order.
        parts = recv.to(home.device).split([ex.rows[i][ex.rank] * matrices[i].shape[1] for i in ex.members])
        return {i: part.view(-1, matrices[i].shape[1]) for i, part in zip(ex.members, parts, strict=True)}

    return finish


def _mesh_device(device_type: str) -> torch.device:
    """The device of a mesh: parameters offloaded to host memory (FSDP2's CPUOffloadPolicy) are still exchanged
    over their NCCL group and orthogonalized on its GPU."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def matrices_per_batch(short: int, long: int, batch_elements: int | None = None) -> int:
    """How many (short, long) matrices one Newton-Schulz batch stacks: up to `batch_elements` (NS_BATCH_ELEMENTS)
    elements, at least one matrix."""
    return max(1, (NS_BATCH_ELEMENTS if batch_elements is None else batch_elements) // (short * long))


def _orthogonalize_whole(whole: dict[int, torch.Tensor], matrices: list[_Matrix],
                         batch_elements: int | None = None) -> int:
    """Replace each whole parameter update (rows, cols) by its orthogonalized matrices, in place; matrices of one
    oriented shape and Newton-Schulz setting run as batches of up to `batch_elements` (NS_BATCH_ELEMENTS) elements,
    at least one matrix each. Returns how many matrices."""
    groups: dict[tuple, list[tuple[int, int, int]]] = {}  # key -> [(index, start row, rows)]
    for i in whole:
        start, cols = 0, matrices[i].shape[1]
        for rows in matrices[i].splits:
            groups.setdefault((min(rows, cols), max(rows, cols), matrices[i].ns_key), []).append((i, start, rows))
            start += rows
    for (short, long, (steps, coefficients, eps)), members in groups.items():
        per_batch = matrices_per_batch(short, long, batch_elements)
        for first in range(0, len(members), per_batch):
            batch = members[first:first + per_batch]
            # Tall matrices transposed: Newton-Schulz's Gram matrix is then the smaller one. The stack is a copy,
            # so each result can go straight back over its input.
            stacked = torch.stack([_oriented(whole[i][lo:lo + rows]) for i, lo, rows in batch])
            orthogonal = newton_schulz(stacked, steps=steps, coefficients=coefficients, eps=eps)
            for (i, lo, rows), result in zip(batch, orthogonal, strict=True):
                whole[i][lo:lo + rows] = result.mT if rows > whole[i].shape[1] else result
            del stacked, orthogonal  # before the next batch allocates its own
    return sum(len(members) for members in groups.values())


def _oriented(x: torch.Tensor) -> torch.Tensor:
    """x, transposed when taller than wide (a view)."""
    return x.mT if x.shape[-2] > x.shape[-1] else x
