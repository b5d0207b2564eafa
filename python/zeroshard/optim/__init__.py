"""The update engine: ``ShardedOptimizer`` (``sharded``) steps every stage through
one shard-source interface, with no stage branches; the per-step gradient
statistics and the ``p.grad`` placeholders (``grads``); the update rules, the
fused AdamW or an elementwise torch optimizer (``rules``), or a whole-tensor one
(Muon, Adafactor) on each parameter's owner rank (``whole``); and the optimizer's
full and sharded state dicts (``state_dict``).

May import: ``native``, ``comm``, ``offload``, ``core``, ``zero12``, ``zero3``.
"""
