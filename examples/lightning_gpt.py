"""A Lightning GPT trained with zeroshard: the LightningModule and the Trainer are the usual
ones; the only zeroshard line is ``strategy="zeroshard_stage_2"`` (after the import that
registers the name).

    torchrun --nproc-per-node 2 examples/lightning_gpt.py [--strategy zeroshard_stage_3] [--ckpt-dir DIR]

The module is examples/train_gpt.py's GPT on its generated corpus, with weight-decay
param groups, a warmup schedule stepped every optimizer step, gradient clipping,
gradient accumulation, validation with ``self.log(..., sync_dist=True)`` and a predict
step. After fit, ``trainer.save_checkpoint`` writes a zeroshard checkpoint directory
(every rank), ``convert_checkpoint`` turns it into one plain Lightning file, and rank 0
loads that with ``LitGPT.load_from_checkpoint`` in its own process and checks that its
validation loss is the one the Trainer logged. ``--strategy ddp`` runs the same script
under Lightning's DDPStrategy.
"""

import argparse
import os
import sys
import tempfile

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, CharData, GPTConfig, make_corpus  # noqa: E402

import zeroshard.integrations.lightning  # noqa: E402,F401  registers strategy="zeroshard..."
from zeroshard.integrations.lightning import convert_checkpoint  # noqa: E402


class LitGPT(L.LightningModule):
    """The GPT as a LightningModule: nothing in it knows about zeroshard."""

    def __init__(
        self,
        vocab: int = 64,
        seq: int = 32,
        layers: int = 2,
        dim: int = 64,
        heads: int = 4,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup: int = 2,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(vocab=vocab, seq=seq, layers=layers, dim=dim, heads=heads))

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        loss = self.model(*batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(*batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])[:, -1]  # the next character's logits

    def configure_optimizers(self):
        params = list(self.named_parameters())
        groups = [
            {"params": [p for _, p in params if p.dim() >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
        warmup = self.hparams.warmup
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def windows(n: int, seq: int, offset: int = 0) -> TensorDataset:
    """``n`` consecutive windows of the corpus (inputs, next-character targets)."""
    data = CharData(make_corpus(60_000), vocab=64).data
    x = torch.stack([data[offset + i * seq : offset + i * seq + seq + 1] for i in range(n)])
    return TensorDataset(x[:, :-1], x[:, 1:])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="zeroshard_stage_2")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--ckpt-dir", default=None)
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    L.seed_everything(0)
    model = LitGPT()
    seq, batch = model.hparams.seq, 4
    train = DataLoader(windows(16 * world, seq), batch_size=batch)
    val = DataLoader(windows(4 * world, seq, offset=40_000), batch_size=batch)
    trainer = L.Trainer(
        strategy=args.strategy,
        devices=world,
        max_epochs=args.epochs,
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, train, val)
    val_loss = trainer.callback_metrics["val_loss"].item()

    ckpt_dir = args.ckpt_dir or tempfile.mkdtemp(prefix="lightning_gpt-")
    ckpt_dir = trainer.strategy.broadcast(ckpt_dir)
    ckpt = os.path.join(ckpt_dir, "last.ckpt")
    trainer.save_checkpoint(ckpt)  # every rank: a directory under zeroshard's strategies
    if trainer.is_global_zero:
        single = os.path.join(ckpt_dir, "last-single.ckpt")
        if os.path.isdir(ckpt):
            convert_checkpoint(ckpt, single)  # one plain Lightning file
        else:
            single = ckpt  # DDPStrategy wrote one file already
        plain = LitGPT.load_from_checkpoint(single, map_location="cpu")
        plain.eval()
        with torch.no_grad():
            losses = [plain.model(x, y).item() for x, y in DataLoader(val.dataset, batch_size=batch)]
        plain_loss = sum(losses) / len(losses)
        assert abs(plain_loss - val_loss) < 1e-4, (plain_loss, val_loss)
        print(
            f"lightning_gpt: {args.strategy} on {world} ranks, {trainer.global_step} optimizer steps: "
            f"val loss {val_loss:.4f}; the converted checkpoint loads with load_from_checkpoint in one "
            f"process and gives {plain_loss:.4f}"
        )
    trainer.strategy.barrier()
    torch.distributed.destroy_process_group()  # (Lightning leaves it up; gloo's threads and the exit race)


if __name__ == "__main__":
    main()
