"""Comparisons the tests share: relative and elementwise errors between tensors, lists and
state dicts, a rank's piece of a parameter, and the refusals a test collects."""


def piece_of(p):
    """What this rank holds of parameter ``p``: its piece under FullyShard (``p.to_local()``),
    else ``p`` itself (detached)."""
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def worst(a: dict, b: dict) -> float:
    """The largest elementwise difference between two state dicts with the same keys."""
    assert a.keys() == b.keys() and len(a) > 0
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def close(a: list, b: list, tol: float = 1e-5) -> bool:
    """Two equally long, non-empty lists of numbers within ``tol`` of each other."""
    return len(a) == len(b) > 0 and max(abs(x - y) for x, y in zip(a, b)) <= tol


def rel_err(a, b):
    """The relative error of ``a`` against ``b`` (flattened, in double)."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_err(sd, ref_sd):
    """The largest relative error between two state dicts with the same keys."""
    assert sd.keys() == ref_sd.keys()
    return max(rel_err(sd[k], ref_sd[k]) for k in ref_sd)


class Refusals(dict):
    """What each call raised, by key (type and message): ``catch(key, fn)`` runs fn and keeps
    a ValueError, NotImplementedError or RuntimeError it raises (the refusals tests read)."""

    def catch(self, key, fn):
        try:
            fn()
        except (ValueError, NotImplementedError, RuntimeError) as e:
            self[key] = f"{type(e).__name__}: {e}"
