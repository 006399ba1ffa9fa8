"""Host staging for asynchronous sharded saves: a copy of this rank's state dict in one host buffer (the arena),
allocated once and reused by every save, so that training can change the originals while the copy is written in
the background (async_save.py). Tensors that may be live training state are copied into the arena (pinned on GPUs,
shared memory for the process writer); tensors the state dict made for this save on the host (FSDP1's offloaded
pieces) are a private copy already and go as they are. Tensor subclasses are copied through their own
flatten/unflatten protocol, whatever their class."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

_ALIGN = 4096  # bytes: each staged tensor starts on its own page (and the arena on a page for pinning)


def storage_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold this rank's data of a state-dict entry, in a fixed order: a
    ShardedTensor's (FSDP1) local shards; for any traceable tensor subclass (DTensor, torchao's FP8
    weights, a DTensor of those) its inner tensors, recursively; else the tensor itself. Only these
    have storage: a subclass's own `untyped_storage()` is an invalid placeholder."""
    if hasattr(t, "local_shards"):
        return [p for shard in t.local_shards() for p in storage_tensors(shard.tensor)]
    if _is_wrapper_subclass(t):
        # The names of its inner tensors, and of opaque members (a DTensor's mesh); the ignore: torch's
        # stubs do not declare the traceable-subclass protocol.
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = [getattr(t, name) for name in names]
        return [p for v in inner if isinstance(v, torch.Tensor) for p in storage_tensors(v)]
    return [t]


def _is_wrapper_subclass(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else 0


def live_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """Storages of the training state (parameters, buffers, optimizer states): a state-dict tensor in
    one of them changes at the next step, so it must be copied before training goes on."""
    tensors = [*model.parameters(), *model.buffers()]
    for per_param in optimizer.state.values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return {_storage(p) for t in tensors for p in storage_tensors(t) if p.numel()}


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a checkpoint holds: all but the frozen ones (a LoRA run's base, see base.py)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's share of the model and optimizer state, as a sharded checkpoint holds it. Before the first
    optimizer step (no state yet) AdamW's two moments are counted as fp32 copies of every parameter."""
    saved = [t for _, t in trainable_parameters(model)]
    params = sum(p.numel() * p.element_size() for t in saved for p in storage_tensors(t))
    if optimizer.state:
        moments = sum(p.numel() * p.element_size() for per_param in optimizer.state.values()
                      for v in per_param.values() if isinstance(v, torch.Tensor) for p in storage_tensors(v))
    else:
        moments = 2 * sum(p.numel() * 4 for t in saved for p in storage_tensors(t))
    return params + moments


@dataclasses.dataclass
class StageStats:
    seconds: float = 0.0  # wall time of stage(), copies included
    copied: int = 0  # bytes copied into the arena
    passed: int = 0  # bytes the state dict had already put in host memory for this save (used as they are)
    allocated: int = 0  # arena bytes allocated during this call (the first save, or a changed layout)
    alloc_seconds: float = 0.0


class HostStaging:
    """Copies of a rank's state-dict tensors in one host arena that is allocated once and reused.

    `stage(state_dict, live=...)` returns a state dict of the same structure whose tensors DCP can write while training
    changes the originals: those that may be live (on the GPU, or sharing storage with the training state) are copied
    into the arena; host tensors made for this save pass as they are, except for the process writer (`share`), which
    gets every tensor through the one shared arena (each tensor shared on its own would cost a file descriptor and a
    copy into /dev/shm at every save); everything else (param_groups) is passed by value."""

    def __init__(self, *, pin: bool, share: bool):
        self.pin, self.share = pin, share
        self._raw: torch.Tensor | None = None  # the arena's memory, page-aligned
        self._registered: int | None = None  # pointer passed to cudaHostRegister
        self._layout: list | None = None
        self._wrappers: dict[tuple, torch.Tensor] = {}
        self.last = StageStats()

    @property
    def nbytes(self) -> int:
        return 0 if self._raw is None else self._raw.numel()

    def reserve(self, nbytes: int) -> float:
        """Allocate (and pin, or share) the arena now, at the start of the run: the first save then
        pays nothing for it, and a host that cannot give it fails here. Returns the seconds it took."""
        start = time.perf_counter()
        self._reserve(nbytes)
        return time.perf_counter() - start

    def _reserve(self, nbytes: int) -> None:
        self.close()
        raw = torch.empty(max(nbytes, 1) + _ALIGN, dtype=torch.uint8)
        if self.share:
            raw.share_memory_()  # one segment, mapped once by the writer process
        shift = (-raw.data_ptr()) % _ALIGN
        self._raw = raw[shift:shift + max(nbytes, 1)]
        if self.pin and nbytes:
            ptr = self._raw.data_ptr()
            code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
            if code == 0:
                self._registered = ptr
            else:
                log.warning("cannot pin the %.1f GiB checkpoint staging buffer (cudaHostRegister error %d): "
                            "copies from the GPU will be slower", nbytes / 2**30, code)

    @torch.no_grad()
    def stage(self, state_dict: dict, *, live: set[int]) -> dict:
        start = time.perf_counter()
        self.last = StageStats()
        leaves: list[tuple[tuple, torch.Tensor]] = []
        skeleton = self._split(state_dict, (), live, leaves)
        layout = [(path, type(t).__name__, [(p.shape, p.dtype) for p in storage_tensors(t)]) for path, t in leaves]
        if layout != self._layout:
            self._allocate(leaves)
            self._layout = layout
        on_gpu = False
        for path, t in leaves:
            for dst, src in zip(storage_tensors(self._wrappers[path]), storage_tensors(t), strict=True):
                dst.copy_(src, non_blocking=src.is_cuda)  # GPU -> pinned: queued on the current stream
                on_gpu |= src.is_cuda
                self.last.copied += src.numel() * src.element_size()
        if on_gpu:
            torch.cuda.current_stream().synchronize()  # the writer reads these bytes next
        staged = _fill(skeleton, self._wrappers)
        self.last.seconds = time.perf_counter() - start
        return staged

    def _split(self, obj: Any, path: tuple, live: set[int], leaves: list) -> Any:
        """The state dict with every tensor to copy replaced by its path (collected in `leaves`)."""
        if isinstance(obj, dict):
            return {k: self._split(v, (*path, k), live, leaves) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._split(v, (*path, i), live, leaves) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, torch.Tensor):
            parts = storage_tensors(obj)
            if not self.share and all(p.device.type == "cpu" and _storage(p) not in live for p in parts):
                self.last.passed += sum(p.numel() * p.element_size() for p in parts)
                return obj  # made for this save (FSDP1's offloaded pieces): already a private copy
            leaves.append((path, obj))
            return _Slot(path)
        return obj  # int, float, str, None: immutable

    def _allocate(self, leaves: list) -> None:
        """Lay the tensors out in the arena (reserved at the start, or grown here if it is too small)."""
        start = time.perf_counter()
        total = sum(_padded(p.numel() * p.element_size()) for _, t in leaves for p in storage_tensors(t))
        if self._raw is None or self._raw.numel() < total:
            if self._raw is not None:
                log.warning("checkpoint staging: the state needs %.2f GiB of host memory, %.2f GiB were reserved; "
                            "allocating it anew", total / 2**30, self._raw.numel() / 2**30)
            self._reserve(total)
            self.last.allocated = total
        arena, offset = self._raw, 0
        assert arena is not None  # reserved above

        def place(like: torch.Tensor) -> torch.Tensor:
            nonlocal offset
            start, nbytes = offset, like.numel() * like.element_size()
            offset += _padded(nbytes)
            if not self.share:
                return _own_slice(arena, start, like)
            view = arena[start:start + nbytes].view(like.dtype).view(like.shape)
            # A tensor of its own on the arena's storage, not a view of it: the process writer receives
            # it through shared memory, and views of the arena crash that transfer.
            return torch.empty(0, dtype=like.dtype).set_(view.untyped_storage(), view.storage_offset(), view.shape,
                                                          view.stride())

        self._wrappers = {path: _host_twin(t, place) for path, t in leaves}
        self.last.alloc_seconds = time.perf_counter() - start

    def close(self) -> None:
        """Unpin and release the arena (DCP must be done with it)."""
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        self._raw, self._wrappers, self._layout = None, {}, None


def _own_slice(arena: torch.Tensor, start: int, like: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped like `like` whose storage is exactly its slice of the arena, from byte `start`.
    DCP's writer copies a tensor whose storage is larger than the tensor before writing it, and the host's
    heap keeps those copies: on the arena's whole storage, every staged tensor would be held twice."""
    if like.numel() == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    flat = torch.frombuffer(arena.numpy(), dtype=like.dtype, count=like.numel(), offset=start)
    return flat.view(like.shape)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def arena_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The arena for a copy of this rank's whole state: state_bytes plus a page per tensor for alignment
    (AdamW: the parameter, two moments and a step per parameter)."""
    return state_bytes(model, optimizer) + 4 * _ALIGN * len(trainable_parameters(model))


@dataclasses.dataclass(frozen=True)
class _Slot:
    path: tuple


def _fill(skeleton: Any, wrappers: dict) -> Any:
    if isinstance(skeleton, _Slot):
        return wrappers[skeleton.path]
    if isinstance(skeleton, dict):
        return {k: _fill(v, wrappers) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_fill(v, wrappers) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_fill(v, wrappers) for v in skeleton)
    return skeleton


def _host_twin(t: torch.Tensor, place: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A tensor of t's kind and shape whose plain tensors (storage_tensors, same order) are arena memory from `place`.
    Tensor subclasses are rebuilt from twins of their inner tensors through the subclass's own flatten/unflatten
    protocol, so a DTensor stays a DTensor (its local part on the host, its mesh kept) and any wrapper inside it (FP8
    weights, say) stays that wrapper: DCP then writes the staged state exactly as it would the original."""
    if hasattr(t, "local_shards"):  # FSDP1's ShardedTensor: no unflatten; a host copy, re-pointed at the arena
        host = t.to("cpu", copy=True)
        assert hasattr(host, "local_shards")  # a copy of a ShardedTensor is one
        for shard, src in zip(host.local_shards(), t.local_shards(), strict=True):
            mine = place(src.tensor)
            shard.tensor.set_(mine.untyped_storage(), mine.storage_offset(), mine.shape, mine.stride())
        return host
    if isinstance(t, DTensor) and not _is_wrapper_subclass(t.to_local()):
        # The common case, built as DTensor's own empty_like builds it: a DTensor rebuilt through unflatten
        # crashes the process writer's transfer to its process.
        host = torch.empty_like(t, device="cpu")
        assert isinstance(host, DTensor)  # empty_like keeps the subclass
        mine = place(t.to_local())
        host.to_local().set_(mine.untyped_storage(), mine.storage_offset(), mine.shape, mine.stride())
        return host
    if _is_wrapper_subclass(t):
        # The ignores: torch's stubs do not declare the traceable-subclass protocol.
        names, context = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = {name: getattr(t, name) for name in names}
        inner = {name: _host_twin(v, place) if isinstance(v, torch.Tensor) else v for name, v in inner.items()}
        twin = type(t).__tensor_unflatten__(inner, context, t.size(), t.stride())  # type: ignore[attr-defined]
        return twin.detach() if twin.requires_grad else twin  # a parameter's flags come along; a copy needs none
    return place(t)


