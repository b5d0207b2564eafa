"""DeepSpeed configs the DeepSpeed tests share: the seed configs and public ones, verbatim
(tests/unit/test_deepspeed_config.py reads them, tests/integration/test_deepspeed_engine.py runs them)."""

# -------------------------------------------------- seed and public configs, unchanged
SEED_000 = {
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 1e6,
    }
}
SEED_003 = {
    "train_batch_size": 32,
    "gradient_accumulation_steps": 4,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "fp16": {"enabled": True},
}
SEED_003_NVME = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
    }
}
# microsoft/DeepSpeedExamples: cifar/ds_config.json, Megatron-LM/scripts/ds_zero3_config.json,
# QANet-Pytorch/ds_bsz512_1cycle.json (verbatim)
CIFAR = {
    "train_batch_size": 4,
    "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "fp16": {
        "enabled": True,
        "fp16_master_weights_and_grads": True,
        "loss_scale": 0,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 1,
        "initial_scale_power": 15,
    },
    "wall_clock_breakdown": False,
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 50000000,
        "reduce_bucket_size": 50000000,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "cpu_offload": True,
    },
}
MEGATRON_Z3 = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": False},
    "wall_clock_breakdown": False,
}
QANET = {
    "train_batch_size": 512,
    "train_micro_batch_size_per_gpu": 32,
    "steps_per_print": 10,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {
        "type": "OneCycle",
        "params": {
            "cycle_min_lr": 0.004,
            "cycle_max_lr": 0.015,
            "cycle_first_step_size": 1000,
            "cycle_second_step_size": 100,
            "cycle_first_stair_count": 100,
            "cycle_second_stair_count": 100,
            "decay_step_size": 1000,
            "decay_lr_rate": 0.01,
        },
    },
}
