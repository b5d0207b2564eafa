"""``ZeroShardStrategy``: Lightning's ``DDPStrategy`` with zeroshard in place of the
DistributedDataParallel wrapper. Processes, the process group, samplers and the
collectives behind ``self.log(sync_dist=True)`` stay DDPStrategy's; what changes is
setup (the optimizer ``configure_optimizers`` returns becomes a ``ShardedOptimizer``;
at stage 3 the LightningModule is wrapped in ``FullyShard`` first), accumulation
(``no_sync`` on non-final micro-batches), checkpoints (a directory, see
``checkpoints``) and teardown (stage 3's parameters stay sharded).
"""

from __future__ import annotations

import contextlib
import weakref
from datetime import timedelta
from typing import Any, Dict, Generator, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

import zeroshard

from . import checkpoints, optimizers
from ..deepspeed.build import block_units
from ..policies import fully_shard_policies

# the LightningModules stage 3 has wrapped, with their FullyShard: a module's parameters stay
# sharded after fit, so a later validate/predict (another Trainer, another strategy) reuses it
_WRAPPED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# the precision plugins whose math is DDPStrategy's with a ShardedOptimizer under it
PLUGINS = (Precision, MixedPrecision, HalfPrecision)
# stage 3 gathers in the precision's low dtype and reduces in fp32 (FSDPStrategy gathers bf16-mixed in bf16 too)
GATHER = {
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
}


def _check_options(stage, wrap, offload, offload_params, kwargs) -> None:
    if kwargs:
        raise TypeError(
            f"ZeroShardStrategy got unexpected arguments {sorted(kwargs)}: DDPStrategy's keyword "
            "arguments for DistributedDataParallel have no meaning here (there is no DDP wrapper; "
            "unused parameters are handled as with find_unused_parameters=True)"
        )
    if stage not in (1, 2, 3):
        raise ValueError(
            f"ZeroShardStrategy(stage={stage!r}): stage is 1 (optimizer state sharded), 2 (also "
            "gradients) or 3 (also parameters, FullyShard)"
        )
    if wrap is not None and stage != 3:
        raise ValueError(
            f"ZeroShardStrategy(wrap=...) chooses stage 3's sharding units; stage={stage} shards no "
            "parameters: drop wrap= or use stage=3"
        )
    if offload_params and stage != 3:
        raise ValueError(
            f"ZeroShardStrategy(offload_params=True) offloads stage 3's parameter shards; at "
            f"stage={stage} use offload='cpu' (the optimizer state) or stage=3"
        )
    if offload not in (None, "cpu", "nvme"):
        raise ValueError(f"ZeroShardStrategy(offload={offload!r}): None, 'cpu' or 'nvme'")


class ZeroShardStrategy(DDPStrategy):
    """ZeRO for ``lightning.pytorch.Trainer(strategy=...)``: pass an instance, or one of
    the names registered when ``zeroshard.integrations.lightning`` is imported
    (``"zeroshard"``, ``"zeroshard_stage_1"`` ... ``"zeroshard_stage_3_offload"``).

    Args:
        stage: 1 (optimizer state sharded), 2 (also gradients; the default) or 3
            (also parameters: the LightningModule is wrapped in ``zeroshard.FullyShard``).
        wrap: stage 3's units: module classes (or a predicate on a module); None:
            each element of the outermost ``nn.ModuleList``s (a transformer's blocks).
        offload: None, ``"cpu"`` or ``"nvme"``: where the optimizer state lives.
        offload_dir: the directory of ``"nvme"``'s files.
        offload_fraction: the share of each rank's optimizer state offloaded.
        offload_params: stage 3: keep the parameter shards in host memory.
        shard_size: hybrid sharding: shard over groups of this many ranks.
        bucket_mb: stages 1/2: the reduce-scatter bucket size, in MiB.
        reshard_after_forward: stage 3: ``FullyShard``'s (free each unit after its forward; an
            int k: keep a piece over k ranks, whose all-gather the backward runs).
        prefetch: stage 3: ``FullyShard``'s (units gathered ahead).
        **kwargs: refused (DDPStrategy's would go to DistributedDataParallel).

    ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
    ``precision_plugin``, ``process_group_backend``, ``timeout`` and ``start_method`` are
    DDPStrategy's.
    """

    strategy_name = "zeroshard"

    def __init__(
        self,
        stage: int = 2,
        wrap=None,
        offload: Optional[str] = None,
        offload_dir=None,
        offload_fraction: float = 1.0,
        shard_size: Optional[int] = None,
        bucket_mb: float = 25,
        offload_params: bool = False,
        reshard_after_forward: Union[bool, int] = True,
        prefetch: int = 1,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
        **kwargs: Any,
    ):
        _check_options(stage, wrap, offload, offload_params, kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.stage = stage
        self.wrap = wrap
        self.offload_params = bool(offload_params)
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.optimizer_options: Dict[str, Any] = dict(
            offload=offload, offload_dir=offload_dir, offload_fraction=offload_fraction, shard_size=shard_size
        )
        if stage != 3:
            self.optimizer_options.update(stage=stage, bucket_mb=bucket_mb)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer) -> None:
        self._check_precision()
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        if self.lightning_module not in _WRAPPED:
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
        elif self.stage == 3:
            self.model = self._fully_shard()
        else:
            self._broadcast_module_states()
        self.setup_precision_plugin()

    def _check_precision(self) -> None:
        plugin = self.precision_plugin
        if type(plugin) not in PLUGINS:
            raise ValueError(
                f"ZeroShardStrategy runs precision '32-true', 'bf16-mixed', '16-mixed', 'bf16-true' "
                f"or '16-true'; got the plugin {type(plugin).__name__}"
            )

    def model_to_device(self) -> None:
        if any(p.is_meta for p in self.model.parameters()):
            return  # stage 3 initialises a model built on meta one unit at a time, on its device
        super().model_to_device()

    def setup_optimizers(self, trainer) -> None:
        """Lightning's parsing of ``configure_optimizers`` (over the plain model), then
        each optimizer rebuilt as a ShardedOptimizer; at stage 3 over the FullyShard
        model, wrapped in between."""
        super().setup_optimizers(trainer)
        given = [o for o in self.optimizers if optimizers.has_params(o)]
        if len(given) > 1:
            raise ValueError(
                f"configure_optimizers returned {len(given)} optimizers; ZeroShardStrategy takes one "
                "(give it several param groups instead)"
            )
        pieces = names = None
        if self.stage == 3:
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            self.model = self._fully_shard()
            pieces = dict(self.model.named_parameters())
        if not given:
            return
        sharded = optimizers.to_sharded(given[0], self.optimizer_options, pieces, names)
        optimizers.move_schedulers(self.lr_scheduler_configs, given[0], sharded)
        self.optimizers = [sharded]

    def _fully_shard(self) -> "zeroshard.FullyShard":
        module = self.lightning_module
        if module not in _WRAPPED:
            low = GATHER.get(getattr(self.precision_plugin, "precision", None))
            mp = zeroshard.MixedPrecision(param_dtype=low, reduce_dtype=torch.float32) if low else None
            wrap = self.wrap if self.wrap is not None else block_units(module)
            _WRAPPED[module] = zeroshard.FullyShard(
                module,
                wrap=wrap,
                mixed_precision=mp,
                reshard_after_forward=self.reshard_after_forward,
                prefetch=self.prefetch,
                **fully_shard_policies(self.offload_params, self.optimizer_options["shard_size"]),
            )
        return _WRAPPED[module]

    @torch.no_grad()
    def _broadcast_module_states(self) -> None:
        """Evaluation without fit (stages 1/2): every rank starts from rank 0's weights, as under DDPStrategy."""
        if dist.get_world_size() > 1:
            for t in list(self.lightning_module.parameters()) + list(self.lightning_module.buffers()):
                dist.broadcast(t.data, 0)

    @property
    def runner(self) -> torch.nn.Module:
        """What trains: the LightningModule, or at stage 3 its FullyShard (also after fit)."""
        return _WRAPPED.get(self.lightning_module, self.lightning_module)

    @property
    def sharded_optimizer(self) -> Optional["zeroshard.ShardedOptimizer"]:
        """The ShardedOptimizer training runs with (None outside fit, or without an optimizer)."""
        found = [o for o in self.optimizers if isinstance(o, zeroshard.ShardedOptimizer)]
        return found[0] if found else None

    # -------------------------------------------------------------- training
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator:
        """Lightning's non-final micro-batches of an accumulation: no communication."""
        opt = self.sharded_optimizer
        with opt.no_sync() if opt is not None else contextlib.nullcontext():
            yield None

    def optimizer_state(self, optimizer) -> dict:
        return {}  # in the checkpoint's rank files (see save_checkpoint)

    def lightning_module_state_dict(self) -> dict:
        return {}  # in the checkpoint's rank files (see save_checkpoint)

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        """Called on every rank (as Lightning does): a directory at ``filepath``, see
        ``zeroshard.integrations.lightning.checkpoints``."""
        if storage_options is not None:
            raise TypeError(
                "trainer.save_checkpoint(..., storage_options=...): ZeroShardStrategy writes zeroshard "
                "checkpoints, not through a CheckpointIO plugin; leave storage_options out"
            )
        checkpoints.save(self.broadcast(str(filepath)), self.runner, self.sharded_optimizer, checkpoint)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return checkpoints.load(
            self.broadcast(str(checkpoint_path)), self.runner, self.sharded_optimizer if fitting else None
        )

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model is wrapped and the ShardedOptimizer built before a checkpoint loads

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint loaded it

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint loaded it

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # load_checkpoint loaded it

    # -------------------------------------------------------------- teardown
    def teardown(self) -> None:
        if self.stage != 3:
            super().teardown()
            return
        # stage 3: the parameters stay sharded on their devices (moving them would read their data)
        self.model = self.lightning_module
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        entries = {
            "zeroshard": ("ZeRO stage 2", dict(stage=2)),
            "zeroshard_stage_1": ("ZeRO stage 1: optimizer state sharded", dict(stage=1)),
            "zeroshard_stage_2": ("ZeRO stage 2: optimizer state and gradients sharded", dict(stage=2)),
            "zeroshard_stage_3": ("ZeRO stage 3: FullyShard, parameters sharded too", dict(stage=3)),
            "zeroshard_stage_2_offload": ("ZeRO stage 2, optimizer state in host memory", dict(stage=2, offload="cpu")),
            "zeroshard_stage_3_offload": (
                "ZeRO stage 3, optimizer state and parameter shards in host memory",
                dict(stage=3, offload="cpu", offload_params=True),
            ),
        }
        for name, (description, options) in entries.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"zeroshard: {description}", **options)
