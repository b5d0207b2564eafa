"""ZeRO-3: ``FullyShard`` (``fully_shard``), the module wrapper whose units
(``records``: Param, Unit, UnitState, MixedPrecision; ``param``: the
ShardedParameter the modules hold between uses) are built from the module
tree at wrapping (``wrap``), all-gathered before use and resharded after
(``gather``) around each call (``forward``, which finds the tensors a unit
returns and casts its inputs with ``outputs``), and reduce-scattered in
backward (``backward``); their memory
report and full state dicts (``state_dict``); and ``UnitSource`` (``source``),
the shard source through which the update engine steps the units' shards.

May import: ``native``, ``comm``, ``offload``, ``core``.
"""
