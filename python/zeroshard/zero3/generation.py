"""Generation on a FullyShard model in one gather per call.

[Note: generation in one gather] Under ZeRO-3 every forward gathers each unit
and reshards it after, so a decoding loop (Hugging Face's ``generate``: one
forward per new token) all-gathers every unit once per token: 32 tokens of a
4-layer Llama issued 448 collectives. ``model.generate(...)`` on a FullyShard
model therefore runs the wrapped model's ``generate`` inside a ``gathered()``
block ([Note: gathered blocks] in zero3/gathered.py): each unit is gathered
once for the call, in the gather dtype (so the tokens are the ones the
per-token path computes), and resharded when it returns or raises; every
``generate`` argument and the KV cache work as on the unsharded model, since
its own ``generate`` runs. A model too large to hold gathered is refused
before anything is gathered, naming the bytes; ``model.generate_gathered =
False`` keeps the per-token gathering for it. Collective, as every forward of
the model is: every rank calls ``generate`` with the same number of decoding
steps (greedy decoding and a sampler seeded alike on every rank give that).
"""

from __future__ import annotations

import contextlib
import functools


def gathered_generate(fs, generate):
    """``generate`` (the wrapped model's) run with ``fs``'s units gathered once per call."""

    @functools.wraps(generate)
    def run(*args, **kwargs):
        if not fs.generate_gathered:
            return generate(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(fs.gathered())
            except RuntimeError as e:
                raise RuntimeError(
                    f"{e}. For generate(): or set model.generate_gathered = False to gather "
                    "unit by unit for every token, as a forward does"
                ) from e
            return generate(*args, **kwargs)

    return run
