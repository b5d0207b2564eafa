"""DeepSpeed's learning-rate schedules (its ``scheduler`` config section), with
its arguments, defaults and formulas: WarmupLR, WarmupDecayLR, WarmupCosineLR,
OneCycle and LRRangeTest. Like DeepSpeed's, each writes ``lr`` (OneCycle also ``betas``)
into the optimizer's param groups, is stepped once per optimizer step that was
applied, and keeps ``last_batch_iteration`` as its whole state.
"""

from __future__ import annotations

import math
from typing import List, Optional

LOG, LINEAR = "log", "linear"


def _per_group(optimizer, value, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(
                f"{name}: expected {len(optimizer.param_groups)} values (one per param group), got {len(value)}"
            )
        return list(value)
    return [value] * len(optimizer.param_groups)


def _warmup_type(kind: str) -> str:
    if kind not in (LOG, LINEAR):
        raise ValueError(f"warmup_type must be \"log\" or \"linear\", got {kind!r}")
    return kind


class _Schedule:
    """What every schedule shares: the step counter, writing lr, the state dict."""

    def __init__(self, optimizer, last_batch_iteration: int):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: Optional[List[float]] = None

    def get_lr(self) -> List[float]:
        raise NotImplementedError

    def _write(self, lrs: List[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._write(self.get_lr())

    def get_last_lr(self) -> List[float]:
        if self._last_lr is None:
            raise RuntimeError("get_last_lr() before the schedule set any learning rate; call step() first")
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class WarmupLR(_Schedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's lr) over
    ``warmup_num_steps`` steps (at least 2), log or linear, then constant."""

    def __init__(
        self,
        optimizer,
        warmup_min_lr=0.0,
        warmup_max_lr=None,
        warmup_num_steps: int = 1000,
        warmup_type: str = LOG,
        last_batch_iteration: int = -1,
    ):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def _warmup(self) -> float:
        if self.warmup_type == LOG:
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _gamma(self) -> float:
        return self._warmup() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warmup (``warmup_max_lr`` defaults to 0.001 here, as DeepSpeed's),
    then linear decay to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_lr=0.0,
        warmup_max_lr=0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = LOG,
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup()
        return max(
            0.0,
            float(self.total_num_steps - self.last_batch_iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR(_Schedule):
    """The optimizer's lr times a ratio: from ``warmup_min_ratio`` to 1 over the warmup,
    then a cosine to ``cos_min_ratio`` at ``total_num_steps``, held there after."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = LOG,
        last_batch_iteration: int = -1,
    ):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps, self.cos_min_ratio = total_num_steps, cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            r = self.inverse_log_warm_up * math.log(it + 1) if self.warmup_type == LOG else it / self.warmup_num_steps
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """The 1cycle policy: lr up from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and back over ``cycle_second_step_size`` (optionally
    in stairs), then decayed by ``decay_lr_rate`` every ``decay_step_size`` steps; with
    ``cycle_momentum``, beta1 cycles inversely between ``cycle_max_mom`` and
    ``cycle_min_mom`` and beta2 is set to 0.99, as DeepSpeed does."""

    def __init__(
        self,
        optimizer,
        cycle_min_lr,
        cycle_max_lr,
        decay_lr_rate=0.0,
        cycle_first_step_size=2000,
        cycle_second_step_size=None,
        cycle_first_stair_count=0,
        cycle_second_stair_count=None,
        decay_step_size=0,
        cycle_momentum=True,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.0,
        last_batch_iteration=-1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0 or second < 0:
            raise ValueError(f"cycle step sizes must be > 0 and >= 0, got {first} and {second}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate, self.decay_mom_rate = decay_lr_rate, decay_mom_rate
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        if last_batch_iteration == -1:
            self._write(self.min_lrs)
        if self.cycle_momentum:
            self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
            if last_batch_iteration == -1:
                for group, betas in zip(optimizer.param_groups, self.min_moms):
                    group["betas"] = betas

    def _scale(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            at = it % self.total_size
            pos = (
                at * stairs / self.first_step_size
                if at <= self.first_step_size
                else (self.total_size - at) * stairs / self.second_step_size
            )
            scale = math.floor(pos) / stairs
        return scale

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self):
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [(hi[0] - (hi[0] - lo[0]) * s, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


class LRRangeTest(_Schedule):
    """The learning-rate range test: ``lr_range_test_min_lr * (1 + lr_range_test_step_rate *
    k / lr_range_test_step_size)`` after k steps (``k // step_size`` with
    ``lr_range_test_staircase``), growing without bound."""

    def __init__(
        self,
        optimizer,
        lr_range_test_min_lr=1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ):
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}")
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate = lr_range_test_step_size, lr_range_test_step_rate
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            self._write(self.min_lrs)

    def get_lr(self) -> List[float]:
        k = (self.last_batch_iteration + 1) / self.step_size
        grow = 1 + self.step_rate * (math.floor(k) if self.staircase else k)
        return [lr * grow for lr in self.min_lrs]


SCHEDULES = {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


def from_config(kind: str, params: dict, optimizer):
    """The schedule a config's ``scheduler`` section names, over ``optimizer``."""
    if kind not in SCHEDULES:
        raise NotImplementedError(
            f"DeepSpeed scheduler type {kind!r}: zeroshard has {sorted(SCHEDULES)}; "
            "or pass lr_scheduler= (a torch scheduler, or a callable taking the optimizer)"
        )
    try:
        return SCHEDULES[kind](optimizer, **params)
    except TypeError as e:
        raise ValueError(f"DeepSpeed config scheduler {kind}: {e}") from None
