"""Hugging Face's Trainer and Accelerate with zeroshard (zeroshard.integrations.hf) against
their own DDP on the same data and seed (transformers, accelerate and trl are test-only
dependencies that `make test` installs).

tests/support/jobs/hf_job.py runs every trainer of a world size in one launch on forked
ranks in torchrun's environment (the Trainer example too): world size 2
first, then 3, which also resumes a checkpoint world size 2 saved. The parent compares:
a tiny GPT-2 (and Llama) from config, accumulation 2, clipping, warmup, the Trainer's
no-decay groups, evaluation and checkpoints every 2 steps. Stages 1-3 give the
Trainer's DDP losses, logged grad_norm, evaluation losses and final parameters within
1e-5; bf16 stays within DDP's own bf16 noise; fp16 skips the same step on every rank,
as DDP; a resume equals the uninterrupted run exactly, and within 1e-5 from 2 ranks to
3; the saved folders load with from_pretrained in one process. TRL's SFT, GRPO and RLOO
trainers (the last two generating inside training) run through the mixin.
"""

import json
import os

import pytest
import torch
from support.checks import close, worst
from support.launch import job, launch, forked_job, forked_jobs

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = job("hf_job.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{world size: rank 0's results} of the job at world sizes 2 and 3 (3 resumes 2's checkpoint)."""
    return forked_jobs(tmp_path_factory, "hf", JOB, timeout=400)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """Rank 0's results of the job's tensor-parallel runs on 4 ranks (tp_size=2 over dp 2)."""
    return forked_job(tmp_path_factory, "hf-tp", JOB, 4, ["--tp"], "results-tp.pt", timeout=400)


def logits(folder_or_params, model_name="gpt2"):
    """Logits of a fixed batch from a saved folder (from_pretrained, one process) or from a
    state dict loaded into the job's model."""
    from support.jobs import hf_job as _hf_job

    if isinstance(folder_or_params, str):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder_or_params)
    else:
        model = _hf_job.gpt2() if model_name == "gpt2" else _hf_job.llama()
        model.load_state_dict(folder_or_params)
    ids = torch.stack([r["input_ids"] for r in _hf_job.rows(3, 9)])
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainer_matches_its_own_ddp(results, world, stage):
    r, ddp = results[world][f"fp32-{stage}"], results[world]["fp32-0"]
    assert len(r["losses"]) == 8 and close(r["losses"], ddp["losses"]), (r["losses"], ddp["losses"])
    assert close(r["norms"], ddp["norms"]) and len(r["norms"]) == 4  # the logged grad_norm: the global one
    assert max(r["norms"]) > 0.5 > 0  # max_grad_norm=0.5 clipped something
    assert r["lrs"] == ddp["lrs"] and r["lrs"][1] < r["lrs"][2]  # the warmup schedule stepped
    assert close(r["eval"], ddp["eval"]) and len(r["eval"]) == 2
    assert worst(r["params"], ddp["params"]) <= TOL
    assert r["losses"][-1] < r["losses"][0] - 0.01  # it trained


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_communication_on_non_final_micro_batches(results, stage):
    for world in (2, 3):
        reduced = results[world][f"fp32-{stage}"]["reduced"]
        added = [b - a for a, b in zip([0] + reduced, reduced)]
        assert added[0::2] == [0] * 4 and len(set(added[1::2])) == 1 and added[1] > 0, added


def test_llama_at_stage_3_matches_ddp(results):
    r, ddp = results[2]["llama-3"], results[2]["llama-0"]
    assert close(r["losses"], ddp["losses"]) and close(r["norms"], ddp["norms"])
    assert worst(r["params"], ddp["params"]) <= TOL


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_models_own_tp_plan_at_tp_size_2_equals_ddp(results, tp_results, stage):
    """zeroshard=dict(stage=s, tp_size=2) on 4 ranks: the Llama's own tp_plan (transformers'
    styles; 16 DTensor parameters) over 2 ranks, zeroshard over the dp 2, against the Trainer's
    DDP on 2 ranks on the same batches: rank 0's losses (it sees dp rank 0's batches), the
    logged norms, evaluation losses and parameters. The stage-3 run's step-2 checkpoint resumed
    at stage 2 ends where that run did; its final save_model folder loads in one process."""
    r, ddp = tp_results[f"tp-{stage}"], results[2]["llama-0"]
    assert r["tp"] == 2 and r.get("dtensors", 16) == 16
    assert close(r["losses"], ddp["losses"]) and close(r["norms"], ddp["norms"]), (r["losses"], ddp["losses"])
    assert close(r["eval"], ddp["eval"]) and len(r["eval"]) == 2
    assert worst(r["params"], ddp["params"]) <= TOL
    if stage == 3:
        assert worst(tp_results["tp-resume"]["params"], r["params"]) <= TOL
        assert (logits(r["final"]) - logits(ddp["params"], "llama")).abs().max() < 1e-4


def test_the_models_own_ep_plan_at_ep_size_2_equals_ddp(tp_results):
    """zeroshard=dict(stage=2, ep_size=2) on 4 ranks: the Qwen3-MoE's own ep_plan (each layer's
    experts a DTensor split over 2 ranks, the tokens exchanged all-to-all), the experts
    sharded over the 2 ranks holding the same ones and the rest over all 4, against the
    Trainer's DDP on the same 4 ranks: the losses, logged norms and parameters; its step-2
    checkpoint resumed at stage 1 ends where it did; its final folder holds the whole
    experts, as DDP's."""
    r, ddp = tp_results["ep-2"], tp_results["ep-0"]
    assert r["experts"] == 4
    assert close(r["losses"], ddp["losses"]) and close(r["norms"], ddp["norms"]), (r["losses"], ddp["losses"])
    assert worst(r["params"], ddp["params"]) <= TOL and ddp["losses"][-1] < ddp["losses"][0]
    assert worst(tp_results["ep-resume"]["params"], r["params"]) <= TOL
    from transformers import AutoModelForCausalLM  # (the files hold the hub's per-expert tensors)

    loaded = AutoModelForCausalLM.from_pretrained(r["final"]).state_dict()
    assert worst(loaded, ddp["params"]) <= TOL and loaded["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4


def test_tp_size_refuses_what_it_does_not_train(tp_results):
    msgs = tp_results["tp-refused"]
    assert "GPT2LMHeadModel has no tp_plan" in msgs["no-plan"]
    assert "'moe_tp_experts' style" in msgs["styles"] and "tp_size=1" in msgs["styles"]
    assert "tp_size=3 must divide the world size (4)" in msgs["world"]
    assert "LlamaForCausalLM has no ep_plan" in msgs["no-ep-plan"]


@pytest.mark.parametrize("name", ["mixtral", "qwen3moe"])
@pytest.mark.parametrize("stage", [2, 3])
def test_mixtures_of_experts_match_ddp(results, name, stage):
    """transformers' Mixtral and Qwen3-MoE (every rank holding every expert; the ranks route
    their tokens to different experts) through ZeroShardTrainer: the Trainer's DDP losses,
    logged norms and parameters."""
    r, ddp = results[2][f"{name}-{stage}"], results[2][f"{name}-0"]
    assert close(r["losses"], ddp["losses"]) and close(r["norms"], ddp["norms"]), (r["losses"], ddp["losses"])
    assert worst(r["params"], ddp["params"]) <= TOL
    assert ddp["losses"][-1] < ddp["losses"][0]


@pytest.mark.parametrize("optim", ["sgd", "adafactor"])
def test_other_optim_arguments_match_ddp(results, optim):
    """``optim="sgd"`` (an elementwise class) and ``"adafactor"`` (transformers' Adafactor,
    run whole-tensor on each parameter's owner) at stage 2."""
    r, ddp = results[2][f"{optim}-2"], results[2][f"{optim}-0"]
    assert close(r["losses"], ddp["losses"]) and close(r["norms"], ddp["norms"])
    assert worst(r["params"], ddp["params"]) <= TOL


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_within_ddps_own_noise(results, stage):
    """bf16=True moves DDP's run from its fp32 run by some amount (its noise). Stage 2 keeps fp32
    parameters under autocast, as DDP: within a tenth of that from DDP's bf16 run. Stage 3 gathers
    the units in bf16, as FSDP does (norms and embeddings compute in bf16 too): its run is as far
    from the fp32 run as DDP's bf16 run is (measured 1.10x), and its gradient norms within 1e-2."""
    res = results[2]
    noise = worst(res["bf16-0"]["params"], res["fp32-0"]["params"])
    assert noise > 1e-4
    if stage == 2:
        assert worst(res["bf16-2"]["params"], res["bf16-0"]["params"]) <= 0.1 * noise
        assert close(res["bf16-2"]["norms"], res["bf16-0"]["norms"], 1e-4)
    else:
        assert worst(res["bf16-3"]["params"], res["fp32-0"]["params"]) <= 1.5 * noise
        assert close(res["bf16-3"]["norms"], res["bf16-0"]["norms"], 1e-2)


def test_fp16_skips_the_same_step_on_every_rank_as_ddp(results):
    """One rank's non-finite micro-batch: every rank skips that step and backs the scale off, as DDP."""
    r, ddp = results[2]["fp16-2"], results[2]["fp16-0"]
    assert r["skipped"] == ddp["skipped"] == [[False, False, True, False]] * 2
    assert r["scale"] == ddp["scale"] == 512.0
    assert worst(r["params"], ddp["params"]) <= TOL


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_equals_the_uninterrupted_run(results, stage):
    """At world size 2 (world size 3 resumes world size 2's checkpoint, below)."""
    r, full = results[2][f"resume-{stage}"], results[2][f"fp32-{stage}"]
    assert r["losses"] == full["losses"][4:] and r["norms"] == full["norms"]  # (the log goes on from the checkpoint's)
    assert all(torch.equal(r["params"][k], full["params"][k]) for k in full["params"])


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_at_world_size_3_from_a_world_size_2_stage_3_checkpoint(results, stage):
    r, full = results[3][f"from-w2-{stage}"], results[3][f"fp32-{stage}"]
    assert close(r["losses"], full["losses"][4:]) and worst(r["params"], full["params"]) <= TOL


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_a_checkpoint_of_the_trainers_own_ddp(results, stage):
    """No zeroshard/ folder: the weights and optimizer.pt (torch's format) load, at stage 3 too."""
    r, ddp = results[2][f"from-ddp-{stage}"], results[2]["fp32-0"]
    assert close(r["losses"], ddp["losses"][4:]) and worst(r["params"], ddp["params"]) <= TOL


@pytest.mark.parametrize("name", ["offload-2", "offload-3"])
def test_offload_options_match_ddp(results, name):
    """``offload="cpu"`` at stage 2; and with ``offload_params=True`` at stage 3."""
    r, ddp = results[2][name], results[2]["fp32-0"]
    assert close(r["losses"], ddp["losses"]) and close(r["norms"], ddp["norms"])
    assert worst(r["params"], ddp["params"]) <= TOL


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_saved_folders_load_with_from_pretrained_in_one_process(results, stage):
    r = results[2][f"fp32-{stage}"]
    want = logits(r["params"])
    for folder in (r["final"], os.path.join(r["out"], "checkpoint-4")):
        assert (logits(folder) - want).abs().max().item() <= TOL
        assert os.path.isdir(os.path.join(folder, "zeroshard")) == folder.endswith("checkpoint-4")
    if stage == 3:  # max_shard_size="40KB": several files and their index, as save_pretrained writes
        with open(os.path.join(r["final"], "model.safetensors.index.json")) as f:
            index = json.load(f)
        files = set(index["weight_map"].values())
        assert len(files) >= 3 and all(os.path.isfile(os.path.join(r["final"], n)) for n in files)
        assert "lm_head.weight" not in index["weight_map"]  # tied: once, as save_pretrained
        assert not os.path.exists(os.path.join(r["final"], ".zeroshard-save"))


def test_save_strategy_best_keeps_and_loads_the_best_checkpoint(results):
    r = results[2]["best-3"]
    best = os.path.join(r["out"], "checkpoint-1")
    assert r["best"] == best and sorted(os.listdir(r["out"])) == ["checkpoint-1", "final"]
    assert (logits(best) - logits(r["params"])).abs().max().item() <= TOL  # load_best_model_at_end


def test_save_model_on_rank_0_alone(results):
    """Stage 2 writes; stage 3 raises on rank 0, naming the call and the fix, instead of hanging."""
    r = results[2]["rank0-save"]
    assert r[2]["error"] is None and "model.safetensors" in r[2]["files"]
    assert "save_model() is collective" in r[3]["error"] and "rank(s) [1]" in r[3]["error"]
    assert "call trainer.save_model() on every rank" in r[3]["error"] and r[3]["files"] == []


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("stage", [2, 3])
def test_trl_rl_trainers_with_generation_inside_training_match_their_ddp(results, kind, stage):
    """TRL's GRPOTrainer and RLOOTrainer through the mixin: each step samples completions with the
    model being trained (HF generate on the sharded model), scores them and steps. At stages 2 and 3
    the completions and rewards are the trainer's own DDP run's, and the losses, grad norms and
    final parameters equal it within the HF tests' tolerance."""
    r, ddp = results[2][f"{kind}-{stage}"], results[2][f"{kind}-0"]
    assert r["completions"] == ddp["completions"] and len(set(ddp["completions"])) > 8, r["completions"][:4]
    assert r["rewards"] == ddp["rewards"] and len(r["rewards"]) == 3, (r["rewards"], ddp["rewards"])
    assert close(r["losses"], ddp["losses"]) and close(r["norms"], ddp["norms"]) and min(ddp["norms"]) > 0.1
    assert worst(r["params"], ddp["params"]) <= TOL


def test_trl_sft_trainer_through_the_mixin(results):
    r = results[2]["sft"]
    assert r["is_zeroshard"] and len(r["losses"]) == 3 and r["losses"][-1] < r["losses"][0]
    assert (logits(r["final"]) - logits(r["params"])).abs().max().item() <= TOL


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_example_matches_its_ddp_and_resumes(results, stage):
    acc = results[2]["accelerate"]
    r, ddp = acc[stage], acc[0]
    assert len(r["losses"]) == 12 and close(r["losses"], ddp["losses"]) and close(r["norms"], ddp["norms"])
    assert worst(r["params"], ddp["params"]) <= TOL
    resumed = acc[f"{stage}-resumed"]
    assert all(torch.equal(resumed["params"][k], r["params"][k]) for k in r["params"])
    assert os.path.isdir(os.path.join(os.path.dirname(r["final"]), "state", "zeroshard"))
    assert (logits(r["final"]) - logits(r["params"])).abs().max().item() <= TOL


@pytest.mark.parametrize("saved, now", [(2, 3), (3, 2)])
def test_accelerate_load_state_at_another_world_size_and_stage(results, saved, now):
    """A save_state of 2 ranks loads on 3, at another stage: the saved fp32 values exactly."""
    from zeroshard.checkpoint import read_full_state_dict

    state = os.path.join(os.path.dirname(results[2]["accelerate"][saved]["final"]), "state", "zeroshard")
    want = dict(read_full_state_dict(state, torch.float32))
    got = results[3]["accelerate-from-w2"][(saved, now)]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_trainer_example_runs_on_two_ranks(tmp_path):
    res = launch(  # (forked ranks in torchrun's environment, as the jobs above)
        "forked",
        os.path.join(ROOT, "examples", "hf_trainer.py"),
        2,
        ["--stage", "3", "--steps", "8", "--out", str(tmp_path)],
        env={"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-4000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("stage 3:")]
    assert line, res.stdout[-2000:]
    assert os.path.isfile(os.path.join(tmp_path, "final", "model.safetensors"))


def test_misuse_is_refused_with_a_clear_error(tmp_path):
    from transformers import TrainingArguments

    from zeroshard.integrations.hf import Options, ZeroShardTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    from support.jobs import hf_job as _hf_job

    for bad, words in (
        (dict(stage=4), "stage is 1"),
        (dict(stages=2), "unknown zeroshard option"),
        (dict(stage=2, wrap=["GPT2Block"]), "wrap= chooses stage 3"),
        (dict(stage=1, offload_params=True), "offload_params=True"),
        (dict(offload="disk"), "offload='disk'"),
        (dict(stage=2, mixed_precision="bf16"), "mixed_precision= sets stage 3"),
        (dict(stage=3, mixed_precision="int8"), "mixed_precision='int8'"),
        (dict(tp_size=0), "tp_size=0"),
        (dict(tp_size=2, shard_size=2), "not supported yet"),
        (dict(stage=3, ep_size=2), "stages 1 and 2"),
    ):
        with pytest.raises((ValueError, TypeError), match=words):
            ZeroShardTrainer(model=_hf_job.gpt2(), args=args, zeroshard=bad)
    with pytest.raises(TypeError, match="takes a dict"):
        Options.parse(2, "ZeroShardTrainer")
    with pytest.raises(ValueError, match="tp_size=2 is ZeroShardTrainer's"):  # (prepare, from_pretrained)
        Options.parse(dict(tp_size=2), "prepare").trainer_only("prepare")


def test_versions_outside_the_tested_range_are_refused(monkeypatch):
    import transformers

    import zeroshard.integrations.hf as hf

    monkeypatch.setattr(transformers, "__version__", "5.30.0")
    with pytest.raises(ImportError, match=r"supports transformers >=5.24,<5.25 .* has transformers 5.30.0"):
        hf._check_versions()
    monkeypatch.setenv("ZEROSHARD_HF_ANY_VERSION", "1")
    hf._check_versions()


def test_export_holds_one_file_of_tensors_at_a_time(tmp_path, monkeypatch):
    """The stage-3 writer streams a zeroshard checkpoint: each safetensors file is written
    from at most ``max_shard_size`` bytes of tensors, and nothing else is held."""
    import safetensors.torch

    import zeroshard
    from zeroshard.integrations.hf import pretrained
    from support.jobs import hf_job as _hf_job

    model = _hf_job.gpt2()
    zeroshard.save_checkpoint(tmp_path / "ck", model)  # one process, no process group
    written, save_file = [], safetensors.torch.save_file

    def counting(tensors, filename, metadata=None):
        written.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        return save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(pretrained.safetensors.torch, "save_file", counting)
    limit = 40 * 1000
    pretrained.export_pretrained(str(tmp_path / "ck"), model, str(tmp_path / "out"), max_shard_size=limit)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(written) >= 3 and sum(written) == total  # every parameter once (tied once)
    assert max(written) <= max(limit, max(p.numel() * p.element_size() for p in model.parameters()))
    assert (logits(str(tmp_path / "out")) - logits(model.state_dict())).abs().max().item() == 0.0


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_from_pretrained_reads_the_published_weights_exactly(results, world, name):
    """Every rank reads its own bytes of files of 20 KB (tensors and ZeRO-3 pieces cross
    their boundaries): the logits equal the plain from_pretrained model's, bit for bit; at
    stage 3 its generate() gathers each unit once for the call, with the plain model's tokens."""
    from transformers import AutoModelForCausalLM

    loaded = results[world]["loaded"]
    assert loaded[f"files-{name}"] >= 5
    folder = os.path.join(results[2]["dir"], f"saved-{name}")
    want = logits(folder)
    for stage in (2, 3):
        assert torch.equal(loaded[f"{name}-{stage}"], want), (name, stage)
    generated = loaded[f"{name}-generated"]
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert torch.equal(generated, plain.generate(generated[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert 0 < loaded[f"{name}-gathers"] <= loaded[f"{name}-units"], loaded[f"{name}-gathers"]


def test_fine_tuning_from_loaded_weights_matches_ddp(results):
    res = results[2]
    for name, ddp in (("ft-3", "ft-0"), ("lora-2", "lora-0"), ("lora-3", "lora-0")):
        r, ref = res[name], res[ddp]
        assert close(r["losses"], ref["losses"]) and close(r["norms"], ref["norms"]), name
        assert worst(r["params"], ref["params"]) <= TOL, name
    trainable = [k for k in res["lora-3"]["params"] if "lora_" in k]
    assert len(trainable) == 8 and trainable[0].startswith("base_model.model.model.layers.0.")
    # the frozen base carries no gradient: memory_report's gradient bytes are the adapter's, exactly
    assert res["lora-3"]["grad_bytes"] == 4 * sum(res["lora-3"]["params"][k].numel() for k in trainable)


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_save_model_writes_the_adapter_peft_loads(results, stage):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    r = results[2][f"lora-{stage}"]
    assert sorted(f for f in os.listdir(r["final"]) if not f.endswith((".md", ".bin"))) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = AutoModelForCausalLM.from_pretrained(os.path.join(results[2]["dir"], "saved-llama"))
    model = PeftModel.from_pretrained(base, r["final"])
    got = {k: v for k, v in model.state_dict().items()}
    assert worst({k: got[k] for k in r["params"]}, r["params"]) == 0


def test_a_wrapped_model_in_another_precision_or_stage_is_refused(results):
    res = results[2]
    assert "gathering its units in torch.float32" in res["refused-precision"], res["refused-precision"]
    assert "mixed_precision='bf16'" in res["refused-precision"]
    assert "sharded at stage 3" in res["refused-stage"]


def test_bf16_gathers_units_in_bf16_at_stage_3(results):
    """bf16=True at stage 3: every unit all-gathered in bf16 (gradients reduced in fp32); fp32 runs gather fp32."""
    res = results[2]
    assert res["bf16-3"]["gathers"] == ["bfloat16"]
    assert res["fp32-3"]["gathers"] == ["float32"] and res["bf16-2"]["gathers"] == []
