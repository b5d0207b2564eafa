"""The ZeRO-1/2 gradient source: ``FlatReducer`` (``reducer``) takes each gradient
from autograd's post-accumulate hook into flat buffers (``flat``), reduce-scatters
complete buckets in the fixed order, and after the step all-gathers the updated
parameters (``param_gather``), blocking or overlapped with the next forward.

May import: ``native``, ``comm``, ``offload``, ``common``.
"""
