"""The ZeRO-1/2 gradient source: ``FlatReducer`` (``reducer``) takes each gradient
from autograd's post-accumulate hook into flat buffers (``flat``), reduce-scatters
complete buckets in the fixed order, and after the step all-gathers the updated
parameters (``param_gather``), blocking or overlapped with the next forward; and keeps the
model's buffers equal to rank 0's, as DDP does (``buffers``).

May import: ``native``, ``comm``, ``offload``, ``core``.
"""
