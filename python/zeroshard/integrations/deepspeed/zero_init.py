"""``zeroshard.zero.Init``: ``deepspeed.zero.Init``'s construction context on zeroshard.

[Note: sharded as built] Inside ``with zeroshard.zero.Init(config_dict_or_path=cfg):``
every module's own ``__init__`` runs as written, on real tensors. When it returns
(the object's outermost ``__init__``, not each base class's), each of that module's
own floating-point parameters takes rank 0's values (a broadcast, as DeepSpeed) and
every rank keeps only its chunk of it (a 1/world share, in the config's dtype); the
parameter stays the same object, now on the meta device. So no rank holds the whole
model: a module's own parameters are whole only while its ``__init__`` runs. As in
DeepSpeed 0.19:

* ``Module.apply(fn)`` inside the block runs ``fn`` on each module with that module's
  parameters gathered, and keeps rank 0's result: the way a parent initialises its
  children (Hugging Face's ``post_init``).
* A write to a parameter already sharded, outside ``apply`` (a parent's ``__init__``
  doing ``self.child.weight.fill_(1.0)``), writes a meta tensor: it is lost, as
  DeepSpeed's write into its empty partition is lost. zeroshard warns, naming the
  module whose ``__init__`` wrote and the parameter (the write moved the parameter's
  version counter; a write through ``.data`` does not move it and is not seen).
* ``zeroshard.initialize`` (``before_wrap``, ``release``): at stage 3, FullyShard's
  meta initialisation rebuilds one unit at a time from the chunks (each module holding
  chunks has, until then, a ``reset_parameters`` that all-gathers them); at stages 1-2
  every parameter is gathered whole first (those stages hold whole parameters anyway).

A model built on the meta device instead (not under this context) is initialised by
its modules' ``reset_parameters()`` only; ``warn_lost_meta_init`` names the parameters
written during construction beyond what their module's ``reset_parameters()`` writes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from . import build
from .config import load

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass
class Chunk:
    local: torch.Tensor  # this rank's piece of the flattened values, padded to ceil(numel / world)
    numel: int
    version: int  # the parameter's version counter when it was last sharded
    built_by: str  # the class whose __init__ made it (for messages)


class ChunkedParameter(nn.Parameter):
    """A parameter sharded as built: a meta tensor of its shape and dtype, the same object
    the module holds (``torch.utils.swap_tensors`` turned it into this class); ``chunk``:
    this rank's piece of its values."""

    chunk: Chunk


# module -> {attribute: sharded parameter} of its own (and modules with buffers: {}), until wrapped
_HOLDERS: "weakref.WeakKeyDictionary[nn.Module, Dict[str, nn.Parameter]]" = weakref.WeakKeyDictionary()
_STATE: dict = {"depth": 0, "dtype": torch.float32, "entered": [], "patched": {}, "apply": None, "subclass": None}


# ------------------------------------------------------------- chunks
def _wire(dtype: torch.dtype) -> torch.dtype:
    """The dtype a chunk travels in: fp32 for fp16/bf16 (exact; gloo's collectives take fp32)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def _shard(p: nn.Parameter, built_by: str, old: Optional[Chunk] = None) -> None:
    """Keep this rank's chunk of rank 0's values of ``p``; ``p`` becomes a meta tensor, a
    ChunkedParameter (``old``: its chunk before it was gathered whole)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = p.detach().reshape(-1).to(_comm_device(), _wire(p.dtype), copy=True)
    if world > 1:
        dist.broadcast(flat, src=0)
    dtype = _STATE["dtype"] if old is None and p.dtype in DTYPES else (old.local.dtype if old else p.dtype)
    size = -(-flat.numel() // world)
    local = torch.zeros(size, dtype=dtype, device=p.device)
    piece = flat[rank * size : (rank + 1) * size]
    local[: piece.numel()].copy_(piece)
    placeholder = ChunkedParameter(torch.empty(p.shape, dtype=dtype, device="meta"), requires_grad=p.requires_grad)
    placeholder.__dict__.update(p.__dict__)  # (swap_tensors swaps the Python attributes and class too)
    placeholder.chunk = Chunk(local, flat.numel(), 0, old.built_by if old else built_by)
    torch.utils.swap_tensors(p, placeholder)
    p.chunk.version = p._version


@torch.no_grad()
def _gather(chunk: Chunk, device: torch.device) -> torch.Tensor:
    """The whole flattened values from every rank's chunk (collective), on ``device``."""
    local = chunk.local.to(_comm_device(), _wire(chunk.local.dtype))
    if dist.get_world_size() > 1:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        local = torch.cat(parts)
    return local[: chunk.numel].to(device)


@torch.no_grad()
def _unshard(p: ChunkedParameter) -> Chunk:
    """``p`` whole again (a plain parameter), from the chunks (collective); returns its chunk."""
    chunk = p.chunk
    full = nn.Parameter(_gather(chunk, chunk.local.device).view(p.shape).to(p.dtype), requires_grad=p.requires_grad)
    full.__dict__.update({k: v for k, v in p.__dict__.items() if k != "chunk"})
    torch.utils.swap_tensors(p, full)
    return chunk


def held_numel(model: nn.Module) -> Tuple[int, int]:
    """(elements this rank holds of ``model``'s sharded parameters, their whole size)."""
    chunks = [p.chunk for p in model.parameters() if isinstance(p, ChunkedParameter)]  # (each once)
    return sum(c.local.numel() for c in chunks), sum(c.numel for c in chunks)


# ------------------------------------------------- the construction hooks
def _restore(module: nn.Module) -> None:
    """A holder's ``reset_parameters`` until it is wrapped: FullyShard's meta initialisation
    calls it, in module order on every rank, on whole fp32 parameters; it fills them from
    the chunks and leaves the module's buffers as its ``__init__`` made them."""
    with torch.no_grad():
        for name, p in _HOLDERS.get(module, {}).items():
            target = module._parameters.get(name)
            if target is not None and not target.is_meta and isinstance(p, ChunkedParameter):
                target.copy_(_gather(p.chunk, target.device).view(target.shape))


def _built(module: nn.Module) -> None:
    """After a module's outermost ``__init__``: shard its own parameters, make it a holder,
    and warn about writes its ``__init__`` made to parameters sharded before."""
    own = {}
    for name, p in module._parameters.items():
        if p is None or not p.is_floating_point() or (p.is_meta and not isinstance(p, ChunkedParameter)):
            continue  # (integers stay whole, as FullyShard keeps them; meta was asked for)
        if not isinstance(p, ChunkedParameter):
            _shard(p, type(module).__name__)
        own[name] = p
    if own or any(b is not None for b in module._buffers.values()):
        _HOLDERS[module] = own
        module.reset_parameters = functools.partial(_restore, module)
    _warn_writes(module.named_parameters(), f"{type(module).__name__}.__init__")


def _warn_writes(named, who: str) -> None:
    """Warn, naming them, about the sharded parameters among ``named`` ((name, parameter)
    pairs) written since they were sharded: the write went to a meta tensor."""
    moved = []
    for name, p in named:
        if isinstance(p, ChunkedParameter) and p._version != p.chunk.version:
            moved.append(f"{name} (made by {p.chunk.built_by})")
            p.chunk.version = p._version
    if moved:
        warnings.warn(
            f"zeroshard.zero.Init: {who} wrote {moved} after their modules were built, when they were already "
            "sharded (meta tensors): the write is lost, as under deepspeed.zero.Init (whose partitions are empty "
            "then). Do it in Module.apply(fn) inside the block (run on the gathered parameters) or in the "
            "module's own __init__ or reset_parameters()",
            stacklevel=3,
        )


def _shard_after(init):
    @functools.wraps(init)
    def wrapper(module, *args, **kwargs):
        entered = _STATE["entered"]  # the modules whose __init__ is running, outermost first
        outermost = all(m is not module for m in entered)
        if outermost:
            entered.append(module)
        try:
            init(module, *args, **kwargs)
        finally:
            if outermost:
                entered[:] = [m for m in entered if m is not module]
        if outermost:
            _built(module)

    return wrapper


def _gathering(fn):
    """``fn`` for ``Module.apply``: run on each module with its sharded parameters whole,
    then sharded again from rank 0's result (DeepSpeed's ``apply`` under ``zero.Init``)."""
    if getattr(fn, "zs_gathering", False):
        return fn

    @functools.wraps(fn)
    def run(module):
        own = [p for p in module._parameters.values() if isinstance(p, ChunkedParameter) and p.is_meta]
        chunks = [_unshard(p) for p in own]
        try:
            fn(module)
        finally:
            for p, chunk in zip(own, chunks):
                _shard(p, type(module).__name__, chunk)

    run.zs_gathering = True
    return run


def _patch_class(cls) -> None:
    init = cls.__dict__.get("__init__")
    if init is not None and cls not in _STATE["patched"]:
        _STATE["patched"][cls] = init
        cls.__init__ = _shard_after(init)


def _subclasses(cls) -> List[type]:
    seen, todo = {}, [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen[sub] = None
                todo.append(sub)
    return list(seen)


def _patch() -> None:
    for cls in _subclasses(nn.Module):
        _patch_class(cls)
    _STATE["subclass"] = nn.Module.__dict__.get("__init_subclass__")
    _STATE["apply"] = apply = nn.Module.apply

    def init_subclass(cls, **kwargs):
        super(nn.Module, cls).__init_subclass__(**kwargs)
        _patch_class(cls)

    nn.Module.__init_subclass__ = classmethod(init_subclass)
    nn.Module.apply = lambda module, fn: apply(module, _gathering(fn))


def _unpatch() -> None:
    for cls, init in _STATE["patched"].items():
        cls.__init__ = init
    _STATE["patched"] = {}
    if _STATE["subclass"] is None:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = _STATE["subclass"]
    nn.Module.apply = _STATE["apply"]
    _STATE["entered"] = []


def _dtype(cfg, dtype):
    """The parameters' dtype: ``dtype``, else the config's fp16/bf16 (else fp32), as DeepSpeed's."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"zeroshard.zero.Init(dtype={dtype}): expected one of {list(DTYPES)}")
        return dtype
    if cfg is None:
        raise ValueError(
            "zeroshard.zero.Init needs config_dict_or_path= (the DeepSpeed config: its fp16/bf16 "
            "section gives the parameters' dtype) or dtype=; DeepSpeed's default without them (fp16 "
            "where its accelerator supports it) depends on the machine"
        )
    raw = load(cfg)
    fp16 = bool((raw.get("fp16") or {}).get("enabled", False))
    bf16 = bool((raw.get("bf16", raw.get("bfloat16")) or {}).get("enabled", False))
    if fp16 and bf16:
        raise ValueError("DeepSpeed config: fp16 and bf16 are both enabled; enable one of them")
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


class Init:
    """``deepspeed.zero.Init``'s arguments and contract: each module's own ``__init__`` runs
    on real values, then its parameters are sharded over the ranks ([Note: sharded as
    built]); ``zeroshard.initialize`` takes the model at any stage. Arguments of
    DeepSpeed's it cannot honour are refused, naming them."""

    def __init__(
        self,
        module=None,
        data_parallel_group=None,
        mem_efficient_linear=True,
        remote_device=None,
        pin_memory=False,
        config_dict_or_path=None,
        config=None,
        enabled=True,
        dtype=None,
        mpu=None,
        zero_param_parallel_group=None,
        zero_quantized_weights=False,
        zero_quantized_nontrainable_weights=False,
        sequence_data_parallel_group=None,
        param_swapper=None,
    ):
        refused = {
            "module": (module is not None, "converts a model built before; build it inside the block"),
            "mpu": (mpu is not None, "zeroshard has no model parallelism"),
            "zero_param_parallel_group": (zero_param_parallel_group is not None, "no hpZ"),
            "zero_quantized_weights": (zero_quantized_weights, "no quantized weights"),
            "zero_quantized_nontrainable_weights": (zero_quantized_nontrainable_weights, "no quantized weights"),
            "param_swapper": (param_swapper is not None, "no NVMe parameter swapper"),
            "remote_device": (str(remote_device).lower() == "nvme", "chunks stay in memory; use \"cpu\""),
        }
        for group, name in (
            (data_parallel_group, "data_parallel_group"),
            (sequence_data_parallel_group, "sequence_data_parallel_group"),
        ):
            refused[name] = (group is not None and group is not dist.group.WORLD, "shards over every rank only")
        for name, (bad, why) in refused.items():
            if bad:
                raise NotImplementedError(f"zeroshard.zero.Init({name}=...): {why}")
        self.enabled = enabled  # (mem_efficient_linear, pin_memory: DeepSpeed's memory tuning)
        self.dtype = (
            _dtype(config_dict_or_path if config_dict_or_path is not None else config, dtype) if enabled else None
        )

    def __enter__(self):
        if self.enabled:
            build.init_distributed(None)
            if _STATE["depth"] == 0:
                _STATE["dtype"] = self.dtype
                _patch()
            _STATE["depth"] += 1
        return self

    def __exit__(self, kind, value, tb):
        if self.enabled:
            _STATE["depth"] -= 1
            if _STATE["depth"] == 0:
                _unpatch()
                if kind is None:
                    _warn_writes(
                        (
                            (f"a parameter of shape {tuple(p.shape)}", p)
                            for own in list(_HOLDERS.values())
                            for p in own.values()
                        ),
                        "code in the zero.Init block",
                    )
        return False


# ---------------------------------------------------------- initialize
def prepare_model(model: nn.Module, cfg):
    """``build.prepare_model`` for ``zeroshard.initialize``, a model built under ``zero.Init``
    (or on meta) included: ``before_wrap`` first."""
    before_wrap(model, cfg.zero.stage)
    return build.prepare_model(model, cfg)


def wrap_model(model: nn.Module, cfg, *more):
    """``build.wrap_model``, then the chunks it rebuilt the units from are forgotten."""
    runner = build.wrap_model(model, cfg, *more)
    release(model)
    return runner


def before_wrap(model: nn.Module, stage: int) -> None:
    """In ``zeroshard.initialize``, before the model is converted and wrapped: warn about
    writes since construction; below stage 3, every sharded parameter whole again."""
    if not any(isinstance(p, ChunkedParameter) for p in model.parameters()):
        warn_lost_meta_init(model)
        return
    _warn_writes(model.named_parameters(), "code after the zero.Init block")
    if stage != 3:
        for p in [p for p in model.parameters() if isinstance(p, ChunkedParameter)]:
            _unshard(p)
        release(model)


def release(model: nn.Module) -> None:
    """Forget ``model``'s chunks and holders (after FullyShard rebuilt it from them)."""
    for mod in model.modules():
        _HOLDERS.pop(mod, None)
        mod.__dict__.pop("reset_parameters", None)


def warn_lost_meta_init(model: nn.Module) -> None:
    """A model built on the meta device: name the parameters its construction wrote more
    times than their module's ``reset_parameters()`` writes them (what FullyShard runs): that
    initialisation (a parent filling a child's weight) is lost."""
    lost = []
    for path, mod in model.named_modules():
        mine = {n: p for n, p in mod._parameters.items() if p is not None and p.is_meta}
        if not mine or not callable(getattr(mod, "reset_parameters", None)):
            continue  # (no reset_parameters: FullyShard warns that they start at zero)
        try:
            twin = copy.deepcopy(mod)
            twin.reset_parameters()
        except Exception:  # noqa: BLE001 - a module that cannot be copied is not judged
            continue
        for n, p in mine.items():
            if p._version > twin._parameters[n]._version:
                lost.append(f"{path}.{n}".lstrip("."))
    if lost:
        warnings.warn(
            f"zeroshard.initialize: the model was built on the meta device, where only reset_parameters() "
            f"initialises parameters; {lost} were written during construction beyond what their module's "
            "reset_parameters() writes (a parent's __init__ filling a child's weight is one), and that is lost. "
            "Build the model under zeroshard.zero.Init (deepspeed.zero.Init's counterpart) to keep it, or load "
            "the values after initialize",
            stacklevel=3,
        )
