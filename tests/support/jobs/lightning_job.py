"""Lightning trainers on zeroshard and on Lightning's DDPStrategy, one after the other in
one torchrun launch (the process group is reused); tests/integration/test_lightning.py launches it
once per world size and compares what rank 0 saves.

    torchrun --nproc-per-node W tests/support/jobs/lightning_job.py OUT_DIR [RESUME_DIR]
    torchrun --nproc-per-node 1 tests/support/jobs/lightning_job.py --device OUT_DIR   # on the GPU if any

Every run trains examples/lightning_gpt.py's LitGPT for 2 epochs of 2 optimizer steps
(global batch 6 at any world size, accumulation 2, clipping, a warmup schedule stepped
per step) and records the logged losses, learning rates and validation losses, the full
final parameters and rank 0's predictions. The zeroshard runs keep a checkpoint per
epoch (ModelCheckpoint) plus top-1/last ones; the stage-2 and stage-3 runs are then
resumed from their first epoch's checkpoint in a fresh model. With RESUME_DIR (a world-2
run's OUT_DIR) the stage-3 epoch-1 checkpoint saved at world size 2 is resumed here, at
stage 3 and at stage 2; without it, DDPStrategy and stages 2 and 3 also train in
bf16-mixed, DDPStrategy and stage 3 clip by value, the two offload strategies train, stage 3 trains a model built on the meta device in
configure_model, and trainer.validate(ckpt_path=) loads the stage-2 run's last
checkpoint at stage 3.

``--device``: world size 1 on the machine's accelerator (the CPU without one):
DDPStrategy and stages 1-3 in 32-true and 16-mixed (with a GradScaler, one micro-batch's
loss made infinite so that every strategy skips that step), into results-device.pt
(tests/integration/test_gpu.py).
"""

import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # (support.*, where torchrun runs this file)
from lightning_gpt import LitGPT, windows  # noqa: E402
from train_gpt import GPT, GPTConfig  # noqa: E402

from zeroshard.integrations.lightning import ZeroShardStrategy  # noqa: E402
from support.records import unit_gather_dtypes  # noqa: E402

GLOBAL_BATCH, EPOCHS = 6, 2


class ListForm(LitGPT):
    """configure_optimizers in Lightning's list form: ([optimizer], [scheduler config])."""

    def configure_optimizers(self):
        d = super().configure_optimizers()
        return [d["optimizer"]], [d["lr_scheduler"]]


class MetaGPT(LitGPT):
    """The GPT built in configure_model on the meta device (stage 3 initialises it unit by unit)."""

    def __init__(self):
        super().__init__()
        del self.model
        self.model = None

    def configure_model(self):
        if self.model is None:
            with torch.device("meta"):
                self.model = GPT(GPTConfig(vocab=64, seq=32, layers=2, dim=64, heads=4))


class Overflow(LitGPT):
    """Under a GradScaler (16-mixed), the third micro-batch's loss is infinite: the step it
    belongs to is skipped and the scale backs off, on every strategy alike."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        return loss * float("inf") if scaler is not None and self.trainer.fit_loop.total_batch_idx == 2 else loss


class RankOverflow(LitGPT):
    """Under a GradScaler, rank 0's third micro-batch alone has an infinite loss: every rank
    must skip that step and back off the scale, as DDPStrategy's all-reduce makes them."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        overflow = scaler is not None and self.trainer.fit_loop.total_batch_idx == 2 and self.trainer.global_rank == 0
        return loss * float("inf") if overflow else loss


class Record(Callback):
    """The logged (rank-averaged) loss, the learning rate and zeroshard's reduce-scattered
    elements so far after every micro-batch, the logged validation loss of every epoch, and
    the device the parameters trained on (Lightning's teardown moves a DDPStrategy's module
    to the CPU after fit)."""

    def __init__(self):
        self.losses, self.lrs, self.val, self.reduced, self.device = [], [], [], [], None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.device = str(next(module.parameters()).device)
        self.losses.append(trainer.callback_metrics["train_loss"].item())
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        opt = getattr(trainer.strategy, "sharded_optimizer", None)  # stages 1/2 count there, FullyShard itself
        counts = getattr(getattr(trainer.strategy, "runner", None), "comm_elements", None) or getattr(
            opt, "comm_elements", None
        )
        self.reduced.append(counts["reduce_scatter"] if counts is not None else None)

    def on_validation_epoch_end(self, trainer, module):
        if "val_loss" in trainer.callback_metrics:
            self.val.append(trainer.callback_metrics["val_loss"].item())


def loaders(world):
    batch = GLOBAL_BATCH // world
    return (
        DataLoader(windows(GLOBAL_BATCH * 4, 32), batch_size=batch),
        DataLoader(windows(GLOBAL_BATCH * 2, 32, offset=40_000), batch_size=batch),
    )


def full_params(trainer) -> dict:
    """{name: full tensor} of the trained LightningModule (collective at stage 3)."""
    runner = getattr(trainer.strategy, "runner", trainer.lightning_module)
    return {k: v.detach().clone() for k, v in runner.state_dict().items()}


def run(
    strategy,
    ckpt_dir=None,
    ckpt_path=None,
    cls=LitGPT,
    seed=0,
    predict=True,
    precision="32-true",
    clip="norm",
    accelerator="cpu",
    plugins=None,
):
    world, t0 = int(os.environ["WORLD_SIZE"]), time.time()
    L.seed_everything(0)  # also the seed of the samplers' shuffling
    torch.manual_seed(seed)  # a resumed run starts from other weights: the checkpoint's must load
    model = cls()
    rec = Record()
    callbacks = [rec]
    if ckpt_dir is not None:
        callbacks += [
            ModelCheckpoint(
                dirpath=os.path.join(ckpt_dir, "every"), filename="{epoch}", every_n_epochs=1, save_top_k=-1
            ),
            ModelCheckpoint(dirpath=os.path.join(ckpt_dir, "best"), monitor="val_loss", save_top_k=1, save_last=True),
        ]
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=world,
        max_epochs=EPOCHS,
        precision=None if plugins else precision,
        plugins=plugins,
        gradient_clip_val=0.5 if clip == "norm" else 0.01,
        gradient_clip_algorithm=clip,
        accumulate_grad_batches=2,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train, val = loaders(world)
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    result = dict(
        losses=rec.losses,
        lrs=rec.lrs,
        val=rec.val,
        reduced=rec.reduced,
        params=full_params(trainer),
        steps=trainer.global_step,
        device=rec.device,
        scale=None if scaler is None else scaler.get_scale(),
        gathers=unit_gather_dtypes(t0),
    )
    if predict:
        result["predictions"] = torch.cat(trainer.predict(model, val))
    return result


def validate(strategy, ckpt_path) -> float:
    """A fresh module's validation loss with the weights of ``ckpt_path`` (no fit)."""
    torch.manual_seed(1)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return trainer.validate(LitGPT(), loaders(int(os.environ["WORLD_SIZE"]))[1], ckpt_path=ckpt_path, verbose=False)[0][
        "val_loss"
    ]


def main_device(out_dir):
    """World size 1 on the accelerator when there is one: see the module's docstring."""
    acc = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for prec in ("32-true", "16-mixed"):
        for name, strategy in (
            ("ddp", "ddp"),
            ("stage1", ZeroShardStrategy(stage=1)),
            ("stage2", "zeroshard_stage_2"),
            ("stage3", "zeroshard_stage_3"),
        ):
            out[f"{name}-{prec}"] = run(strategy, cls=Overflow, precision=prec, predict=False, accelerator=acc)
    torch.save(out, os.path.join(out_dir, "results-device.pt"))
    torch.distributed.destroy_process_group()


def main():
    if sys.argv[1] == "--device":
        return main_device(sys.argv[2])
    out_dir = sys.argv[1]
    resume_dir = sys.argv[2] if len(sys.argv) > 2 else None
    world = int(os.environ["WORLD_SIZE"])
    out = {
        "ddp": run("ddp"),
        "stage1": run(ZeroShardStrategy(stage=1), cls=ListForm),
        "stage2": run("zeroshard_stage_2", ckpt_dir=os.path.join(out_dir, "ckpt-stage2")),
        "stage3": run(ZeroShardStrategy(stage=3), ckpt_dir=os.path.join(out_dir, "ckpt-stage3")),
        "resumed": {},
    }
    for stage in (2, 3):
        mid = os.path.join(out_dir, f"ckpt-stage{stage}", "every", "epoch=0.ckpt")
        out["resumed"][f"stage{stage}"] = run(ZeroShardStrategy(stage=stage), ckpt_path=mid, seed=1, predict=False)
    if resume_dir is not None:
        mid = os.path.join(resume_dir, "ckpt-stage3", "every", "epoch=0.ckpt")
        for stage in (3, 2):
            out["resumed"][f"w2-stage3-to-stage{stage}"] = run(
                ZeroShardStrategy(stage=stage), ckpt_path=mid, seed=1, predict=False
            )
    else:
        for name, strategy in (("ddp", "ddp"), ("stage2", "zeroshard_stage_2"), ("stage3", "zeroshard_stage_3")):
            out[f"{name}-bf16"] = run(strategy, precision="bf16-mixed", predict=False)
        for name, strategy in (("ddp", "ddp"), ("stage2", "zeroshard_stage_2"), ("stage3", "zeroshard_stage_3")):
            # fp16 autocast and Lightning's GradScaler on the CPU (its precision="16-mixed" means
            # bf16 there, so the plugin is passed as an instance)
            out[f"{name}-fp16"] = run(
                strategy, cls=RankOverflow, predict=False, plugins=[MixedPrecision("16-mixed", "cpu")]
            )
        for name in ("zeroshard_stage_2_offload", "zeroshard_stage_3_offload"):
            out[name] = run(name, predict=False)
        for name, strategy in (("ddp", "ddp"), ("stage3", "zeroshard_stage_3")):
            out[f"{name}-value"] = run(strategy, clip="value", predict=False)
        out["stage3-meta"] = run("zeroshard_stage_3", cls=MetaGPT, predict=False)
        out["validated"] = validate("zeroshard_stage_3", os.path.join(out_dir, "ckpt-stage2", "every", "epoch=1.ckpt"))
    out["listings"] = {
        stage: sorted(os.listdir(os.path.join(out_dir, f"ckpt-stage{stage}", "best"))) for stage in (2, 3)
    }
    if int(os.environ["RANK"]) == 0:
        torch.save(out, os.path.join(out_dir, f"results-w{world}.pt"))
    # Lightning leaves the process group up; torn down by the interpreter's exit, gloo's threads
    # can end the process with std::terminate (SIGABRT) after the results are written
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
