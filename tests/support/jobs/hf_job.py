"""One torchrun launch of the Hugging Face tests (tests/integration/test_hf.py) at one world size:
every Trainer (its own DDP, zeroshard at stages 1-3, bf16, fp16, other optimizers,
Llama, resumes, TRL's SFTTrainer through the mixin) and the Accelerate example's
runs, in one process group. Rank 0 writes results-w<world>.pt into the output
directory; the parent compares.

    torchrun --nproc-per-node 2 tests/support/jobs/hf_job.py OUT [CHECKPOINT_FROM_WORLD_2]
    torchrun --nproc-per-node 4 tests/support/jobs/hf_job.py --tp OUT        # tp_size=2 over dp 2: results-tp.pt
    torchrun --nproc-per-node 1 tests/support/jobs/hf_job.py --device OUT    # on the GPU when there is one

``--device``: world size 1 on the machine's accelerator (NCCL; gloo and the CPU without
one): the Trainer's own training against zeroshard at stages 1-3, fp32 and bf16, into
results-device.pt (tests/integration/test_gpu.py).
"""

import importlib.util
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import zeroshard
from zeroshard.integrations.hf import ZeroShardTrainer, ZeroShardTrainerMixin, from_pretrained

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # (support.*, where torchrun runs this file)
from support.records import unit_gather_dtypes  # noqa: E402

VOCAB, SEQ = 101, 16
transformers.logging.set_verbosity_error()


def gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=56,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )


def mixtral(seed=0):
    """A Mixtral (top-2 of 4 experts per layer; transformers 5 holds each layer's experts as
    3-D parameters)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )


def qwen3_moe(seed=0):
    """A Qwen3-MoE (top-2 of 4 experts, q/k norms)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=24,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )


def rows(n, seed):
    """Sequences counting up by a random stride from a random start (learnable)."""
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": x, "labels": x} for x in ids]


TRAIN, EVAL = rows(120, 1), rows(22, 5)  # 22: evaluation batches that split unevenly over the ranks


class Recorder(TrainerCallback):
    """Per micro-batch: the elements reduce-scattered so far (zeroshard runs)."""

    def __init__(self):
        self.trainer, self.reduced = None, []

    def _count(self):
        t = self.trainer
        if t is None or getattr(t, "sharded_optimizer", None) is None:
            return
        counts = getattr(t.zeroshard_model, "comm_elements", None) or t.sharded_optimizer.comm_elements
        self.reduced.append(counts["reduce_scatter"])

    def on_substep_end(self, args, state, control, **kw):
        self._count()

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self._count()


class Losses:
    """Every training micro-batch's loss, unrounded (the Trainer's logs round to 4 digits)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if model.training:
            self.losses.append((out[0] if return_outputs else out).item())
        return out


class PlainT(Losses, Trainer):
    pass


class ZeroT(Losses, ZeroShardTrainer):
    pass


def arguments(out, **kw):
    base = dict(
        output_dir=out,
        per_device_train_batch_size=12,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=2e-3,
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=0.5,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=6,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        seed=3,
        use_cpu=True,
        disable_tqdm=True,
        accelerator_config={"split_batches": True},
        dataloader_drop_last=True,
    )
    base.update(kw)
    return TrainingArguments(**base)


def full_params(trainer, stage):
    """The whole model's tensors (tensor-parallel ones gathered over tp: collective)."""
    from torch.distributed.tensor import DTensor

    runner = trainer.zeroshard_model if stage else trainer.model
    sd = runner.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in sd.items()}


def run(stage, out, model_fn=gpt2, resume=None, trainer_cls=None, hook=None, **kw):
    t0 = time.time()
    model = model_fn()
    if hook is not None:
        hook(model)
    rec = Recorder()
    cls = trainer_cls or (ZeroT if stage else PlainT)
    extra = dict(zeroshard=kw.pop("zeroshard", dict(stage=stage))) if stage else {}
    t = cls(model=model, args=arguments(out, **kw), train_dataset=TRAIN, eval_dataset=EVAL, callbacks=[rec], **extra)
    t.losses, rec.trainer = [], t
    t.train(resume_from_checkpoint=resume)
    logs = t.state.log_history
    result = dict(
        losses=t.losses,
        reduced=rec.reduced,
        out=out,
        norms=[h["grad_norm"] for h in logs if "grad_norm" in h],
        lrs=[h["learning_rate"] for h in logs if "learning_rate" in h and "loss" in h],
        eval=[h["eval_loss"] for h in logs if "eval_loss" in h],
        params=full_params(t, stage),
        best=t.state.best_model_checkpoint,
        device=str(next(iter(t.model.parameters())).device),
        gathers=unit_gather_dtypes(t0),
    )
    final = os.path.join(out, "final")
    t.save_model(final)  # every rank, as Trainer scripts do
    result["final"] = final
    return result, t


def rank_0_saves(trainers, d):
    """``save_model`` under ``if rank == 0:``: at stage 2 it writes (no collective); at
    stage 3 rank 0 gets CollectiveTimeout naming the call within the timeout, and
    rank 1, already in the next collective, goes on once rank 0 joins it."""
    out = {}
    zeroshard.set_timeout(5)
    for stage in (2, 3):
        target, error = os.path.join(d, f"rank0-save-{stage}"), None
        if dist.get_rank() == 0:
            try:
                trainers[stage].save_model(target)
            except zeroshard.CollectiveTimeout as e:
                error = str(e)
        dist.barrier()
        out[stage] = dict(error=error, files=sorted(os.listdir(target)) if os.path.isdir(target) else [])
    zeroshard.set_timeout(None)
    return out


def nan_on_rank_1_at_step_2(model):
    """Rank 1's first micro-batch of step 2 gives non-finite gradients (a skipped fp16 step)."""
    calls = []

    def hook(module, args, output):
        if module.training and torch.is_grad_enabled():
            calls.append(1)
            if dist.get_rank() == 1 and len(calls) == 5:
                return output * float("inf")
        return output

    model.transformer.wte.register_forward_hook(hook)


class Skips(TrainerCallback):
    """Whether each optimizer step was skipped, on this rank."""

    def __init__(self):
        self.trainer, self.skipped = None, []

    def on_step_end(self, args, state, control, **kw):
        self.skipped.append(self.trainer.accelerator.optimizer_step_was_skipped)


def fp16_run(stage, out):
    """fp16 with a GradScaler and one non-finite micro-batch on rank 1 only. Accelerate
    creates its GradScaler on GPUs only; here the CPU one it would use stands in."""
    model = gpt2()
    nan_on_rank_1_at_step_2(model)
    skips = Skips()
    cls = ZeroT if stage else PlainT
    extra = dict(zeroshard=dict(stage=stage)) if stage else {}
    # adamw_torch: with the fused AdamW, torch's GradScaler calls step() even on an overflow (the kernel
    # skips inside), so Accelerate reports the step as taken and the DDP run's schedule moves on
    t = cls(
        model=model,
        args=arguments(out, fp16=True, eval_strategy="no", save_strategy="no", optim="adamw_torch"),
        train_dataset=TRAIN,
        callbacks=[skips],
        **extra,
    )
    t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    t.losses, skips.trainer = [], t
    t.train()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, skips.skipped)
    return dict(losses=t.losses, skipped=every, scale=t.accelerator.scaler.get_scale(), params=full_params(t, stage))


# what every TRL trainer of the job is given: 3 steps of 4 rows a rank on the CPU, logged, unsaved
TRL_ARGS = dict(
    per_device_train_batch_size=4,
    max_steps=3,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    save_strategy="no",
    seed=3,
)


def sft_run(out):
    """TRL's SFTTrainer through the mixin, given a model from_pretrained loaded at stage 3: trains and saves."""
    import datasets
    import trl
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
        pad_token="t0",
        eos_token="t0",
        unk_token="t1",
    )

    class SFT(ZeroShardTrainerMixin, trl.SFTTrainer):
        pass

    ds = datasets.Dataset.from_list([{"input_ids": r["input_ids"].tolist()} for r in TRAIN[:48]])
    cfg = trl.SFTConfig(output_dir=out, learning_rate=2e-3, max_length=SEQ, **TRL_ARGS)
    from transformers import AutoModelForCausalLM  # the model from_pretrained wrapped: the mixin takes it

    opts = dict(stage=3, mixed_precision="bf16")  # SFTConfig's bf16=True by default: bf16 gathers
    model = from_pretrained(AutoModelForCausalLM, os.path.join(os.path.dirname(out), "saved-gpt2"), zeroshard=opts)
    t = SFT(model=model, args=cfg, train_dataset=ds, processing_class=tok, zeroshard=opts)
    t.train()
    t.save_model(os.path.join(out, "final"))
    return dict(
        losses=[h["loss"] for h in t.state.log_history if "loss" in h],
        final=os.path.join(out, "final"),
        params=full_params(t, 3),
        is_zeroshard=isinstance(t.optimizer.optimizer, zeroshard.ShardedOptimizer),
    )


def word_tokenizer():
    """A tokenizer of the words t0..t100 (t0 pads and ends), padding on the left for generation."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="t0", eos_token="t0", unk_token="t1", padding_side="left"
    )


def rl_runs(d):
    """TRL's GRPOTrainer and RLOOTrainer (generation inside training: sampled completions scored by
    a reward function) as the trainer itself runs them under DDP (stage 0) and through the mixin at
    stages 2 and 3: {kind-stage: completions, rewards, losses, grad norms, final parameters}."""
    import datasets
    import trl

    g = torch.Generator().manual_seed(11)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(2, VOCAB, (5,), generator=g)) for _ in range(16)]
    data = datasets.Dataset.from_list([{"prompt": p} for p in prompts])
    out = {}
    for kind, trainer, config in (("grpo", trl.GRPOTrainer, trl.GRPOConfig), ("rloo", trl.RLOOTrainer, trl.RLOOConfig)):
        for stage in (0, 2, 3):
            seen = []

            def reward(completions, **kw):  # (the words' numbers mod 7: completions differ in reward)
                seen.extend(completions)
                return [sum(int(t[1:]) % 7 for t in c.split()) / 10.0 for c in completions]

            args = config(
                output_dir=os.path.join(d, f"{kind}-{stage}"),
                num_generations=4,
                max_completion_length=6,
                learning_rate=5e-3,
                bf16=False,
                beta=0.0,  # (no reference model: RLOO's default would load one from the hub)
                **TRL_ARGS,
            )
            cls = type(f"Zero{trainer.__name__}", (ZeroShardTrainerMixin, trainer), {}) if stage else trainer
            extra = dict(zeroshard=dict(stage=stage)) if stage else {}
            t = cls(
                model=gpt2(),
                reward_funcs=reward,
                args=args,
                train_dataset=data,
                processing_class=word_tokenizer(),
                **extra,
            )
            t.train()
            logs = t.state.log_history
            out[f"{kind}-{stage}"] = dict(
                completions=seen,
                rewards=[h["reward"] for h in logs if "reward" in h],
                losses=[h["loss"] for h in logs if "loss" in h],
                norms=[h["grad_norm"] for h in logs if "grad_norm" in h],
                params=full_params(t, stage),
            )
    return out


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def loaded_logits(d):
    """A Llama and a GPT-2 (tied, Conv1D) saved in files of 20 KB, loaded by from_pretrained at
    stages 2 and 3: the logits of a fixed batch, and the files' count."""
    from transformers import AutoModelForCausalLM

    ids, out = torch.stack([r["input_ids"] for r in rows(3, 9)]), {}
    for name, fn in (("llama", llama), ("gpt2", gpt2)):
        folder = os.path.join(d, f"saved-{name}")
        if dist.get_rank() == 0:
            fn(seed=4).save_pretrained(folder, max_shard_size="20KB")
        dist.barrier()
        out[f"files-{name}"] = len([f for f in os.listdir(folder) if f.endswith(".safetensors")])
        for stage in (2, 3):
            model = from_pretrained(AutoModelForCausalLM, folder, zeroshard=dict(stage=stage))
            with torch.no_grad():
                out[f"{name}-{stage}"] = model(input_ids=ids).logits
        t0 = time.time()  # generate() on the stage-3 model: one all-gather per unit for the call
        out[f"{name}-generated"] = model.generate(ids[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
        out[f"{name}-gathers"] = sum(r["kind"] == "all_gather" and r["start"] >= t0 for r in zeroshard.flight_record())
        out[f"{name}-units"] = len(model.units)
    return out


def fine_tunes(d):
    """From the saved Llama: full fine-tuning at stage 3 and LoRA at stages 2 and 3 (with
    gradient checkpointing) from from_pretrained, against the Trainer's DDP from
    AutoModelForCausalLM.from_pretrained (+ get_peft_model, the adapter started where
    zeroshard's started); the gradient bytes memory_report counts, over the ranks."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder, out = os.path.join(d, "saved-llama"), {}
    plain = lambda: AutoModelForCausalLM.from_pretrained(folder)  # noqa: E731
    kw = dict(model_fn=plain, save_strategy="no", eval_strategy="no")
    out["ft-0"], _ = run(0, os.path.join(d, "ft-0"), **kw)
    kw["model_fn"] = lambda: from_pretrained(AutoModelForCausalLM, folder, zeroshard=dict(stage=3))  # noqa: E731
    out["ft-3"], _ = run(3, os.path.join(d, "ft-3"), zeroshard=dict(stage=3), **kw)
    for stage in (2, 3):
        torch.manual_seed(11)
        model = from_pretrained(
            AutoModelForCausalLM, folder, zeroshard=dict(stage=stage), peft_config=LoraConfig(**LORA)
        )
        if stage == 3:
            names = [n for n, p in model.module.named_parameters() if p.requires_grad]
            start = model.state_dict(keys=names)
        kw["model_fn"] = lambda: model  # noqa: E731
        out[f"lora-{stage}"], t = run(stage, os.path.join(d, f"lora-{stage}"), gradient_checkpointing=True, **kw)
        grads = torch.tensor(float(t.zeroshard_model.memory_report()["grads"] if stage == 3 else 0))
        dist.all_reduce(grads)
        out[f"lora-{stage}"]["grad_bytes"] = int(grads)
    wrapped = from_pretrained(AutoModelForCausalLM, folder, zeroshard=dict(stage=3))  # gathers in fp32
    for name, given in (("precision", dict(stage=3)), ("stage", dict(stage=2))):
        try:
            ZeroT(
                model=wrapped,
                args=arguments(os.path.join(d, "refused"), bf16=True, eval_strategy="no"),
                zeroshard=given,
            )
        except ValueError as e:
            out[f"refused-{name}"] = str(e)
    kw["model_fn"] = lambda: get_peft_model(plain(), LoraConfig(**LORA))  # noqa: E731
    out["lora-0"], _ = run(0, os.path.join(d, "lora-0"), hook=lambda m: m.load_state_dict(start, strict=False), **kw)
    return out


def example():
    spec = importlib.util.spec_from_file_location("hf_accelerate", os.path.join(ROOT, "examples", "hf_accelerate.py"))
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    return ex


def accelerate_runs(d):
    ex = example()
    out = {}
    from accelerate.state import AcceleratorState

    for stage in (0, 2, 3):
        o = os.path.join(d, f"acc{stage}")
        AcceleratorState._reset_state()  # the Trainers before left their precision in the singleton
        out[stage] = ex.train(stage, 6, o, save_at=3)
        AcceleratorState._reset_state()
        out[f"{stage}-resumed"] = ex.train(stage, 6, o, resume=True, save_at=3)
    return out


def accelerate_loads(from_w2):
    """World 3: ``load_state`` of the Accelerate example's world-2 states, at another stage
    (saved at 2, loaded at 3, and back); the parameters right after the load."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from zeroshard.integrations import hf

    ex = example()
    out = {}
    for saved, now in ((2, 3), (3, 2)):
        AcceleratorState._reset_state()
        accelerator = Accelerator(gradient_accumulation_steps=2)
        model = ex.build_model(seed=7)  # other weights than the saved ones
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        model, opt = hf.prepare(accelerator, model, opt, stage=now)
        accelerator.load_state(os.path.join(from_w2, f"acc{saved}", "state"))
        out[(saved, now)] = {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}
    return out


def main_device(d):
    """World size 1 on the accelerator when there is one: see the module's docstring."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    res = {}
    for prec, stages in (("fp32", (0, 1, 2, 3)), ("bf16", (0, 2, 3))):
        for stage in stages:
            res[f"{prec}-{stage}"], _ = run(
                stage, os.path.join(d, f"{prec}-{stage}"), use_cpu=not cuda, save_strategy="no", bf16=prec == "bf16"
            )
    torch.save(res, os.path.join(d, "results-device.pt"))
    dist.destroy_process_group()


def main_tp(d):
    """World size 4: the Llama's own tp_plan over tp_size=2 ranks, zeroshard over the dp 2 at
    stages 1-3 (world 2's DDP run, llama-0, is the reference); the stage-3 run's step-2
    checkpoint resumed at stage 2; the Qwen3-MoE's own ep_plan over ep_size=2 at stage 2
    against the Trainer's DDP at world 4, its checkpoint resumed at stage 1; what is not
    supported refused."""
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo")
    res = {}
    for stage in (1, 2, 3):
        res[f"tp-{stage}"], t = run(
            stage, os.path.join(d, f"tp-{stage}"), model_fn=llama, zeroshard=dict(stage=stage, tp_size=2)
        )
        res[f"tp-{stage}"]["tp"] = t.zeroshard_mesh["tp"].size()
        if stage != 3:  # (at stage 3 the DTensors exist while a unit computes)
            res[f"tp-{stage}"]["dtensors"] = sum(isinstance(p, DTensor) for p in t.model.parameters())
    res["tp-resume"], _ = run(
        2,
        os.path.join(d, "tp-resume"),
        model_fn=llama,
        zeroshard=dict(stage=2, tp_size=2),
        resume=os.path.join(d, "tp-3", "checkpoint-2"),
    )
    # expert parallelism: the Qwen3-MoE's own ep_plan over 2 ranks (each its own batch, the tokens
    # exchanged all-to-all), the experts sharded over the 2 ranks holding the same ones
    no_eval = dict(model_fn=qwen3_moe, eval_strategy="no")
    res["ep-0"], _ = run(0, os.path.join(d, "ep-0"), save_strategy="no", **no_eval)
    res["ep-2"], t = run(2, os.path.join(d, "ep-2"), zeroshard=dict(stage=2, ep_size=2), **no_eval)
    res["ep-2"]["experts"] = sum(isinstance(p, DTensor) for p in t.model.parameters())
    res["ep-resume"], _ = run(
        1,
        os.path.join(d, "ep-resume"),
        zeroshard=dict(stage=1, ep_size=2),
        save_strategy="no",
        resume=os.path.join(d, "ep-2", "checkpoint-2"),
        **no_eval,
    )
    refused = {}
    for name, fn, tp in (("no-plan", gpt2, 2), ("styles", qwen3_moe, 2), ("world", llama, 3)):
        try:
            ZeroT(
                model=fn(),
                args=arguments(os.path.join(d, "refused"), eval_strategy="no"),
                zeroshard=dict(stage=2, tp_size=tp),
            )
        except ValueError as e:
            refused[name] = str(e)
    try:
        ZeroT(
            model=llama(),
            args=arguments(os.path.join(d, "refused"), eval_strategy="no"),
            zeroshard=dict(stage=2, ep_size=2),
        )
    except ValueError as e:
        refused["no-ep-plan"] = str(e)
    res["tp-refused"] = refused
    if dist.get_rank() == 0:
        torch.save(res, os.path.join(d, "results-tp.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main():
    if sys.argv[1] == "--device":
        return main_device(sys.argv[2])
    if sys.argv[1] == "--tp":
        return main_tp(sys.argv[2])
    d = sys.argv[1]
    from_w2 = sys.argv[2] if len(sys.argv) > 2 else None
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    res, trainers = {}, {}
    for stage in (0, 1, 2, 3):
        kw = dict(zeroshard=dict(stage=3, max_shard_size="40KB")) if stage == 3 else {}
        res[f"fp32-{stage}"], trainers[stage] = run(stage, os.path.join(d, f"fp32-{stage}"), **kw)
    if from_w2 is None:
        res["rank0-save"] = rank_0_saves(trainers, d)
    for stage in (2, 3) if from_w2 is None else ():  # resume at step 2 of the same world size: the same state
        ck, out = os.path.join(d, f"fp32-{stage}", "checkpoint-2"), os.path.join(d, f"resume-{stage}")
        if stage == 2:  # resume_from_checkpoint=True: the newest checkpoint in output_dir
            if dist.get_rank() == 0:
                shutil.copytree(ck, os.path.join(out, "checkpoint-2"))
            dist.barrier()
            ck = True
        res[f"resume-{stage}"], _ = run(stage, out, resume=ck)
    res["loaded"] = loaded_logits(d)
    if from_w2 is None:
        res.update(fine_tunes(d))
    if from_w2 is not None:  # world 3: resume world 2's stage-3 checkpoint, at stages 3 and 2
        for stage in (2, 3):
            ck = os.path.join(from_w2, "fp32-3", "checkpoint-2")
            res[f"from-w2-{stage}"], _ = run(stage, os.path.join(d, f"from-w2-{stage}"), resume=ck)
        res["accelerate-from-w2"] = accelerate_loads(from_w2)
    else:
        for stage in (2, 3):  # a checkpoint of the Trainer's own DDP run: its weights and optimizer.pt
            ck = os.path.join(d, "fp32-0", "checkpoint-2")
            res[f"from-ddp-{stage}"], _ = run(
                stage, os.path.join(d, f"from-ddp-{stage}"), resume=ck, save_strategy="no"
            )
        res["offload-2"], _ = run(
            2, os.path.join(d, "offload-2"), zeroshard=dict(stage=2, offload="cpu"), save_strategy="no"
        )
        res["offload-3"], _ = run(
            3,
            os.path.join(d, "offload-3"),
            save_strategy="no",
            zeroshard=dict(stage=3, offload="cpu", offload_params=True),
        )
        for stage in (0, 2, 3):
            res[f"bf16-{stage}"], _ = run(stage, os.path.join(d, f"bf16-{stage}"), bf16=True)
        for stage in (0, 2):
            res[f"fp16-{stage}"] = fp16_run(stage, os.path.join(d, f"fp16-{stage}"))
        for stage in (0, 3):
            res[f"llama-{stage}"], _ = run(stage, os.path.join(d, f"llama-{stage}"), model_fn=llama, save_strategy="no")
        for name, fn in (("mixtral", mixtral), ("qwen3moe", qwen3_moe)):  # mixtures of experts
            for stage in (0, 2, 3):
                res[f"{name}-{stage}"], _ = run(
                    stage, os.path.join(d, f"{name}-{stage}"), model_fn=fn, eval_strategy="no", save_strategy="no"
                )
        for optim in ("sgd", "adafactor"):
            for stage in (0, 2):
                # Llama: no biases (GPT-2's attention key bias has a zero gradient, whose rounding noise
                # Adafactor's normalisation turns into updates of the learning rate's size)
                res[f"{optim}-{stage}"], _ = run(
                    stage,
                    os.path.join(d, f"{optim}-{stage}"),
                    model_fn=llama,
                    optim=optim,
                    eval_strategy="no",
                    save_strategy="no",
                )
        # "best" = the highest evaluation loss: the first evaluation's checkpoint, loaded at the end
        res["best-3"], _ = run(
            3,
            os.path.join(d, "best-3"),
            save_strategy="best",
            metric_for_best_model="eval_loss",
            greater_is_better=True,
            load_best_model_at_end=True,
            eval_steps=1,
            max_steps=3,
            save_total_limit=1,
        )
        res["sft"] = sft_run(os.path.join(d, "sft"))
        res.update(rl_runs(d))
        res["accelerate"] = accelerate_runs(d)
    if dist.get_rank() == 0:
        torch.save(res, os.path.join(d, f"results-w{world}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
