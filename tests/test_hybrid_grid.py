"""Every sharding setup trains like one process, or is refused before the process group starts.

The grid: fsdp.version (1, 2) x fsdp.sharding_strategy x fsdp.hybrid_shard_group_size (0 = the processes
per node, 1 to 4) at world sizes 1, 2 (two nodes of one process) and 4 (two nodes of two). A setup that
launch_problems refuses must be refused in one line naming fsdp.hybrid_shard_group_size. Every other one
(once for the strategies other than HYBRID_SHARD, which never read the group size) trains a few steps in
one spawned gloo world per world size (all its setups share those ranks) and must give the losses and
gradient norms of the same steps taken by one process without FSDP."""
from __future__ import annotations

import functools

import pytest
import torch

from config import launch_problems, load_config
from tests.helpers import ROOT

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
GROUP_SIZES = (0, 1, 2, 3, 4)
# world size -> processes per node: world 2 is two nodes of one process (a shard group of 0 is then 1).
NODES = {1: 1, 2: 1, 4: 2}
GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN, STEPS = 8, 2, 16, 3
SEED = 5


def model_config():
    from model import ModelConfig

    return ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ_LEN)


def global_batches() -> torch.Tensor:
    """The tokens of every step's global batch, (STEPS, GLOBAL_BATCH, SEQ_LEN + 1)."""
    return torch.randint(0, 64, (STEPS, GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(SEED))


def make_optimizer(params) -> torch.optim.Optimizer:
    # Elementwise (no weight decay): FSDP1's flat parameters get exactly the update of the original ones.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, foreach=False)


@functools.cache
def reference() -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) of each step, from one process without FSDP: the loss is the
    global batch's mean over equal micro-batches, which is what the ranks' mean of their micro-batch means
    is, and the norm is clipped to 1 as the ranks' step clips it."""
    from model import Transformer

    torch.manual_seed(0)
    model = Transformer(model_config())
    model.init_weights(seed=SEED)
    optimizer = make_optimizer(model.parameters())
    out = []
    for tokens in global_batches():
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append((loss.item(), norm.item()))
    return out


def train_grid(rank: int, world_size: int, *, local_world_size: int, setups: list) -> dict:
    """On this rank: each setup (version, strategy, group size) trained STEPS steps from the same start,
    with this rank's share of each global batch; its (loss, gradient norm) per step."""
    from config import FSDPConfig
    from fsdp_utils.distributed import DistEnv
    from fsdp_utils.parallel.fsdp import fsdp_adapter
    from fsdp_utils.parallel.parallelize import resolve_precision
    from fsdp_utils.train.step import train_step
    from model import DecoderBlock, Transformer
    from tests.helpers import parallelize

    env = DistEnv(rank=rank, local_rank=rank % local_world_size, world_size=world_size,
                  local_world_size=local_world_size, device=torch.device("cpu"))
    per_rank = GLOBAL_BATCH // world_size
    grad_accum = per_rank // MICRO_BATCH
    mine = global_batches()[:, rank * per_rank:(rank + 1) * per_rank]
    results = {}
    for version, strategy, group in setups:
        module = Transformer(model_config())
        module.init_weights(seed=SEED)
        fsdp = FSDPConfig(version=version, sharding_strategy=strategy, hybrid_shard_group_size=group)
        adapter = fsdp_adapter(fsdp, env)
        model = parallelize(module, fsdp=adapter, block_classes={DecoderBlock}, compile=False,
                            precision=resolve_precision("fp32", "fp32", env.device))
        optimizer = make_optimizer(model.parameters())
        rows = []
        for tokens in mine:
            micro = iter([(t[:, :-1], t[:, 1:]) for t in tokens.split(MICRO_BATCH)])
            result = train_step(model, optimizer, micro, fsdp=adapter, grad_accum=grad_accum, grad_clip=1.0,
                                world_size=world_size)
            rows.append((result.loss.item(), result.grad_norm.item()))
        results[(version, strategy, group)] = rows
    return results


def plan(tmp_path, world_size: int) -> tuple[list, dict]:
    """The setups launch_problems lets train at this world size, and the refused ones with their lines."""
    trained, refused = [], {}
    for version in (1, 2):
        for strategy in STRATEGIES:
            for group in GROUP_SIZES:
                cfg = load_config(ROOT / "config/train_tiny_fsdp.yaml", [
                    f"--fsdp.version={version}", f"--fsdp.sharding_strategy={strategy}",
                    f"--fsdp.hybrid_shard_group_size={group}", "--run.device=cpu", f"--run.output_dir={tmp_path}",
                    f"--train.global_batch_size={GLOBAL_BATCH}", f"--train.micro_batch_size={MICRO_BATCH}"])
                problems = launch_problems(cfg, world_size=world_size, local_world_size=NODES[world_size], num_gpus=0)
                if problems:
                    refused[(version, strategy, group)] = problems
                elif strategy == "HYBRID_SHARD" or group == 0:  # other strategies never read the group size
                    trained.append((version, strategy, group))
    return trained, refused


@pytest.mark.slow  # spawns gloo ranks
@pytest.mark.parametrize("world_size", sorted(NODES))
def test_every_sharding_trains_like_one_process_or_is_refused(world_size, tmp_path):
    from tests.distributed_harness import run_ranks

    trained, refused = plan(tmp_path, world_size)
    # Refused: exactly the hybrid shard groups that do not divide the world (group 0 is the node's processes,
    # which always divide it), each in one line.
    assert sorted(refused) == [(v, "HYBRID_SHARD", g) for v in (1, 2) for g in GROUP_SIZES if g and world_size % g]
    for problems in refused.values():
        assert len(problems) == 1 and "fsdp.hybrid_shard_group_size" in problems[0]
    expected = reference()
    ranks = run_ranks(train_grid, world_size=world_size, timeout_s=600, local_world_size=NODES[world_size],
                      setups=trained)
    for setup in trained:
        got = ranks[0][setup]
        assert all(r[setup] == got for r in ranks), setup  # every rank reduced to the same values
        # Same arithmetic up to the order of the sums (the ranks' partial losses and gradients): a few float32
        # roundings, far below what a step on another batch or an unreduced gradient changes.
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-6, atol=0, msg=str(setup))


def test_the_log_names_the_sharding_that_runs():
    from config import FSDPConfig
    from fsdp_utils.distributed import DistEnv
    from fsdp_utils.parallel.fsdp import fsdp_adapter

    def described(strategy: str, group: int, world_size: int, local_world_size: int, version: int = 1) -> str:
        env = DistEnv(rank=0, local_rank=0, world_size=world_size, local_world_size=local_world_size,
                      device=torch.device("cpu"))
        f = FSDPConfig(version=version, sharding_strategy=strategy, hybrid_shard_group_size=group)
        return fsdp_adapter(f, env).describe()

    # One process per node (group 0 is then 1): every rank holds everything and all-reduces over the world.
    assert described("HYBRID_SHARD", 0, 2, 1) == \
        "FSDP1 NO_SHARD (fsdp.sharding_strategy=HYBRID_SHARD with shard groups of 1 of 2 ranks)"
    assert described("HYBRID_SHARD", 4, 4, 2) == \
        "FSDP1 FULL_SHARD (fsdp.sharding_strategy=HYBRID_SHARD with shard groups of 4 of 4 ranks)"
    assert described("HYBRID_SHARD", 0, 8, 4) == "FSDP1 HYBRID_SHARD (2 replicas x 4 shards)"
    assert described("SHARD_GRAD_OP", 2, 4, 2) == "FSDP1 SHARD_GRAD_OP"
    # FSDP1 on one process runs every strategy as NO_SHARD (torch warns that it switched); FSDP2 keeps its mesh of one.
    assert described("FULL_SHARD", 0, 1, 1) == "FSDP1 NO_SHARD (one process; fsdp.sharding_strategy=FULL_SHARD)"
    assert described("FULL_SHARD", 0, 1, 1, version=2) == "FSDP2 FULL_SHARD"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fsdp1_on_one_process_runs_no_shard_without_torch_warning_of_it(strategy, world_of_one):
    """One process (a plain `python train_fsdp.py`, or an elastic job shrunk to one rank): NO_SHARD is what
    runs, chosen by us and said in the log line above, not by FSDP1 with its warning that it switched."""
    import warnings

    from config import FSDPConfig
    from fsdp_utils.parallel.fsdp import fsdp_adapter
    from fsdp_utils.parallel.parallelize import resolve_precision
    from model import DecoderBlock, Transformer
    from tests.helpers import parallelize

    module = Transformer(model_config())
    module.init_weights(seed=SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp = fsdp_adapter(FSDPConfig(version=1, sharding_strategy=strategy), world_of_one)
        model = parallelize(module, fsdp=fsdp, block_classes={DecoderBlock}, compile=False,
                            precision=resolve_precision("fp32", "fp32", world_of_one.device))
    assert not [w for w in caught if "NO_SHARD" in str(w.message)], [str(w.message) for w in caught]
    tokens = global_batches()[0]
    loss = model(tokens[:, :-1], tokens[:, 1:])
    assert loss.item() == pytest.approx(reference()[0][0], rel=1e-6)  # and it computes what one process does
