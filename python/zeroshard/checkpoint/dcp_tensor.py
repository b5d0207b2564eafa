"""The ShardedTensor of zeroshard's DCP state dicts, made so that ``dcp.async_save``'s
staging can copy it (see [Note: DCP adapter] in checkpoint/dcp.py).

torch's default stager (``dcp.async_save``) copies a state dict to host memory with a
deep copy that treats every tensor as a plain one: it asks for its ``data_ptr()``
(ShardedTensor refuses: it has no storage of its own), makes ``new_empty`` of it
(refused too), then copies the object's attributes, its process group among them
(which cannot be copied). ``FlatShardedTensor`` answers the first two as a tensor
without storage does (0; an empty shell of its class, whose attributes the stager
then fills with copies: the local shards' data staged in host memory, the metadata),
and keeps its process group in a box that copies as itself. It also answers the
size, shape, dtype and device queries DCP's planner makes of every tensor directly,
as ShardedTensor's own ops would, and gives DCP's save planner write items for its
non-empty shards only (``__create_write_items__``): the empty shard a rank that holds
none of a tensor keeps for the key's sake (checkpoint/dcp.py) costs no write, where DCP's
writer spends a fixed, measurable time on every item, empty or not. Everything else is
ShardedTensor's own behaviour.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


# what the wrapper tensor answers itself, as ShardedTensor's default ops do, without their
# deprecation warning and argument walk on each call (DCP asks for them of every tensor, many times a load)
_OWN = {torch.Tensor.size, torch.Tensor.shape.__get__, torch.Tensor.dim, torch.Tensor.dtype.__get__}


class _Shared:
    """A value every copy of its holder shares: a deep copy is the box itself."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self


class FlatShardedTensor(ShardedTensor):
    """A ShardedTensor that ``dcp.async_save``'s staging can copy (see the module's doc)."""

    @property
    def _process_group(self):
        box = self.__dict__.get("_group_box")
        return None if box is None else box.value

    @_process_group.setter
    def _process_group(self, group):
        self.__dict__["_group_box"] = _Shared(group)

    def adopt(self, shards: List[Shard], meta: ShardedTensorMetadata, group) -> None:
        """Hold ``shards`` of ``meta`` over ``group``: the fields ShardedTensor's own
        constructors set (no sharding spec: DCP does not read it)."""
        self._metadata, self._local_shards, self._sharding_spec = meta, shards, None
        self._process_group, self._init_rrefs, self._sharded_tensor_id, self._remote_shards = group, False, None, {}

    def __create_write_items__(self, fqn: str, obj) -> List[WriteItem]:
        """DCP's write items for this rank's shards, as it makes them for any ShardedTensor,
        leaving out empty ones (a tensor with no element has one, so that its key is written)."""
        shards = [s for s in self.local_shards() if s.tensor.numel() or not self.metadata().size.numel()]
        props = self.metadata().tensor_properties
        properties = TensorProperties(
            dtype=props.dtype,
            layout=props.layout,
            requires_grad=props.requires_grad,
            memory_format=props.memory_format,
            pin_memory=props.pin_memory,
        )
        items = []
        for shard in shards:
            md = shard.metadata
            offsets = torch.Size(md.shard_offsets)
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(md.shard_sizes)),
                        properties=properties,
                        size=self.metadata().size,
                    ),
                )
            )
        return items

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.data_ptr:
            return 0  # (no storage of its own: the local shards hold the data)
        if func is torch.Tensor.new_empty:
            this = args[0]
            return torch.Tensor._make_wrapper_subclass(
                cls, this.size(), dtype=this.dtype, layout=torch.strided, requires_grad=False
            )
        if func in _OWN:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func == torch.Tensor.device.__get__ and args[0].local_shards():
            return args[0].local_shards()[0].tensor.device
        return super().__torch_function__(func, types, args, kwargs)


def flat_sharded_tensor(shards: List[Shard], meta: ShardedTensorMetadata, group) -> FlatShardedTensor:
    """A FlatShardedTensor of ``meta`` with this rank's ``shards``, as torch's
    ``ShardedTensor._init_from_local_shards_and_global_metadata`` makes one but without
    its checks of every shard against every other (pairwise: O(shards²) per tensor,
    quadratic in the ranks): the rectangles a flat
    range is cut into never overlap and tile it (tests/unit/test_dcp_layout.py)."""
    props = meta.tensor_properties
    made = torch.Tensor._make_wrapper_subclass(
        FlatShardedTensor, meta.size, dtype=props.dtype, layout=torch.strided, requires_grad=False
    )
    made.adopt(shards, meta, group if group is not None else dist.group.WORLD)
    return made
