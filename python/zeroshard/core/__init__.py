"""The core's two abstractions, which every stage plugs into, and what they share: the
shard interface the update engine drives (``source``: ShardSource, GradState;
[Note: shard sources]), the segments it updates (``segments``) and the regions
state dicts and checkpoints read (``regions``); the one reduction pipeline every
stage's gradients go through (``reduction``; [Note: reduction pipeline]) and its
recycled buffers (``pool``); the hooks both sources install (``hooks``); which
party holds a parameter (``claims``; [Note: construction order]); the loose
options mapped onto policies (``policies``); DTensor parameters' local pieces
(``tensor_parallel``).

May import: ``native``, ``comm``, ``offload``.
"""
