"""What the update engine and both gradient sources share: the shard-source
interface the engine drives (``source``: Segment, Region, ShardSource,
GradState; [Note: shard sources]), the one reduction order every rank follows
(``order``), the recycled reduction buffers (``pool``) and which optimizer was
built over a parameter (``claims``; [Note: construction order]).

May import: ``native``, ``comm``, ``offload``.
"""
