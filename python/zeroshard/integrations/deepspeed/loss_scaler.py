"""The fp16 loss scale, with DeepSpeed's rules (its ``fp16`` config section).

A static scale (``loss_scale`` > 0) never changes. A dynamic one starts at
``2 ** initial_scale_power``. An overflowing step is skipped; it halves the
scale (never below ``min_loss_scale``) once ``hysteresis`` overflows have
been seen since the scale last grew (``consecutive_hysteresis``: since the
last clean step). Every ``loss_scale_window`` clean steps since the last
overflow, the scale doubles and the hysteresis is refilled.

One difference from DeepSpeed, on purpose: DeepSpeed updates the scale
before it unscales the gradients, so on a step where the scale doubles it
divides the gradients by the new scale, half the one the backward used
(unless clipping rescales them anyway). The engine here unscales by the
scale the backward used, as ``torch.amp.GradScaler`` and DDP do; the scale
and the skipped steps are DeepSpeed's (tests/integration/test_deepspeed_engine.py).
"""

from __future__ import annotations

from .config import LossScaling


class LossScaler:
    """``scale`` multiplies the loss before backward; ``update(overflow)`` after each step."""

    def __init__(self, cfg: LossScaling):
        self.dynamic = cfg.enabled and cfg.dynamic
        self.scale = float(2**cfg.initial_scale_power) if self.dynamic else (cfg.loss_scale if cfg.enabled else 1.0)
        self.window, self.min_scale = cfg.loss_scale_window, cfg.min_loss_scale
        self.hysteresis = self.delayed_shift = cfg.hysteresis
        self.consecutive = cfg.consecutive_hysteresis
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.hysteresis == 1:
                if self.scale == self.min_scale:
                    raise RuntimeError(
                        f"fp16 loss scale is already at min_loss_scale {self.min_scale} and the "
                        "gradients still overflow (DeepSpeed stops here too); check the model for "
                        "inf/NaN or lower the learning rate"
                    )
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive:
                self.hysteresis = self.delayed_shift
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive:
                    self.hysteresis = self.delayed_shift
                self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict:
        return dict(
            scale=self.scale, hysteresis=self.hysteresis, iteration=self.iteration, last_overflow=self.last_overflow
        )

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.hysteresis = sd["scale"], sd["hysteresis"]
        self.iteration, self.last_overflow = sd["iteration"], sd["last_overflow"]
