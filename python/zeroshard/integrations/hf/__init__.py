"""zeroshard for Hugging Face's ``Trainer`` and Accelerate (docs/huggingface.md).

``ZeroShardTrainer`` in place of ``transformers.Trainer`` (``zeroshard=dict(stage=2)``);
``ZeroShardTrainerMixin`` for Trainer subclasses (TRL's ``SFTTrainer``, ...);
``prepare`` for ``accelerate launch`` scripts; ``from_pretrained`` (a published
model loaded into its shards, no full copy on any rank); ``save_pretrained``
(collective at stage 3). The Trainer's private methods change between releases, so the
transformers versions this module was tested with are checked at import; the
``hf`` extra in pyproject.toml pins the same range. The only module that imports
transformers or accelerate.
"""

from __future__ import annotations

import os

import accelerate
import transformers
from packaging.version import Version

# the releases tested (tests/integration/test_hf.py); ZEROSHARD_HF_ANY_VERSION=1 skips the check, at your risk
TRANSFORMERS = (Version("5.24"), Version("5.25"))  # >= first, < second
ACCELERATE = (Version("1.15"), Version("1.16"))
# the Trainer methods ZeroShardTrainerMixin overrides or calls; their absence means another design
TRAINER_METHODS = (
    "_prepare_for_training",
    "create_optimizer",
    "create_scheduler",
    "_wrap_model",
    "training_step",
    "save_model",
    "_save_optimizer_and_scheduler",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_best_model",
    "_load_scaler",
    "_clip_grad_norm",
    "_get_grad_norm",
    "_move_model_to_device",
    "_get_dataloader",
    "get_tp_size",
)


def _check_versions() -> None:
    if os.environ.get("ZEROSHARD_HF_ANY_VERSION") == "1":
        return
    for module, (low, high) in ((transformers, TRANSFORMERS), (accelerate, ACCELERATE)):
        have = Version(Version(module.__version__).base_version)
        if not low <= have < high:
            raise ImportError(
                f"zeroshard.integrations.hf supports {module.__name__} >={low},<{high} (what it is tested with; "
                f"the Trainer's private methods it builds on change between releases); this environment has "
                f"{module.__name__} {module.__version__}. Install the tested range with "
                f"pip install 'zeroshard[hf]', or set ZEROSHARD_HF_ANY_VERSION=1 to try this one at your own risk"
            )
    missing = [m for m in TRAINER_METHODS if not hasattr(transformers.Trainer, m)]
    if missing:
        raise ImportError(
            f"zeroshard.integrations.hf: transformers {transformers.__version__}'s Trainer lacks "
            f"{missing}, which the integration builds on"
        )


_check_versions()

from .accelerate import prepare  # noqa: E402
from .loading import from_pretrained  # noqa: E402
from .options import Options  # noqa: E402
from .pretrained import save_pretrained  # noqa: E402
from .trainer import ZeroShardTrainerMixin  # noqa: E402


class ZeroShardTrainer(ZeroShardTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` trained with zeroshard: the same arguments, plus
    ``zeroshard=dict(stage=1|2|3, ...)`` (``Options``' keys)."""


__all__ = ["Options", "ZeroShardTrainer", "ZeroShardTrainerMixin", "from_pretrained", "prepare", "save_pretrained"]
