"""optim/slots.py: where each parameter's statistics sit when some param group shards over
its own ranks (one slot per group of ranks) and when none does (the parameter indices)."""

import torch

from zeroshard.optim.slots import Slots


def test_identity_without_groups_of_their_own():
    s = Slots(None, 3, torch.device("cpu"))
    v = torch.tensor([1.0, 2.0, 3.0])
    assert s.identity and s.size == 3 and s.spread(v) is v and s.own(v) is v
    assert s.of_params([2, 0]) == [2, 0] and s.own_of([1]) == [1]


def test_each_group_its_slot():
    # parameters 0 and 2 dense; 1 sharded over one of 2 groups, this rank in group 1
    s = Slots([(0, 1), (1, 2), (0, 1)], 3, torch.device("cpu"))
    assert not s.identity and s.size == 4
    spread = s.spread(torch.tensor([1.0, 2.0, 3.0]))
    assert spread.tolist() == [1.0, 0.0, 2.0, 3.0]  # slots: p0, p1 group 0, p1 group 1, p2
    other = Slots([(0, 1), (0, 2), (0, 1)], 3, torch.device("cpu")).spread(torch.tensor([1.0, 5.0, 3.0]))
    total = spread + other  # the all-reduce over both ranks
    assert s.own(total).tolist() == [2.0, 2.0, 6.0]  # this rank's parameter 1 is its group's
    assert s.summed(total).tolist() == [2.0, 7.0, 6.0]  # both groups' parameters at place 1
    assert s.of_params([1]) == [1, 2] and s.own_of([1, 2]) == [2, 3]
