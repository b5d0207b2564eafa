"""What a rank's flight record says: a test's own observations placed among the collectives
it issued (``Timeline``), and the dtypes of the units' all-gathers."""


class Timeline:
    """What a test observes through its own hooks, placed among the collectives of the
    flight record: ``mark(what, name)`` notes an observation; ``events()`` returns the
    marks and the collectives issued since the Timeline was made, in order, as
    (what, name) pairs: collectives as ("reduce_scatter" / "all_gather" / ..., the bucket
    index or unit name their flight record names), marks as given. A mark made after
    the n-th collective comes after it and before the (n + 1)-th."""

    def __init__(self):
        from zeroshard.comm import flight

        self._flight, self._start, self._marks = flight, flight.issued(), []

    def mark(self, what: str, name) -> None:
        self._marks.append((self._flight.issued(), (what, name)))

    def grad_hooks(self, named_params) -> list:
        """Marks ("grad", name) each time autograd accumulates one of ``named_params``'
        gradients (after the library's own hook for it, registered earlier)."""
        return [
            p.register_post_accumulate_grad_hook(lambda p, n=n: self.mark("grad", n))
            for n, p in named_params
            if p.requires_grad
        ]

    def events(self) -> list:
        import re

        recs = self._flight.flight_record()
        first = self._flight.issued() - len(recs) + 1  # the issue number of recs[0]
        out, marks = [], iter(self._marks)
        mark = next(marks, None)
        for n, rec in enumerate(recs, start=first):
            if n <= self._start:
                continue
            while mark is not None and mark[0] < n:
                out.append(mark[1])
                mark = next(marks, None)
            unit = re.search(r"unit '([^']*)'", rec["what"])
            bucket = re.search(r"bucket (\d+)", rec["what"])
            out.append((rec["kind"], unit.group(1) if unit else int(bucket.group(1)) if bucket else rec["what"]))
        out += [m[1] for m in ([mark] if mark is not None else []) + list(marks)]
        return out


def unit_gather_dtypes(since: float) -> list:
    """The dtypes of the units' all-gathers this rank issued since ``since`` (time.time()), from the flight record."""
    import zeroshard

    return sorted(
        {
            r["dtype"]
            for r in zeroshard.flight_record()
            if r["kind"] == "all_gather"
            and "all-gather" in r["what"]
            and ", unit '" in r["what"]
            and r["start"] >= since
        }
    )
