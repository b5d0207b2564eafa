"""What the update engine and both gradient sources share: the shard-source
interface the engine drives (``source``: Segment, Region, ShardSource,
GradState; [Note: shard sources]), the one reduction order every rank follows
(``order``) and the recycled reduction buffers (``pool``).

May import: ``native``, ``comm``, ``offload``.
"""
