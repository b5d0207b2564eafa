"""``from_pretrained``: a published Hugging Face model built on meta, wrapped for its
stage and loaded with ``zeroshard.load_pretrained``: every rank reads only its own
bytes of the safetensors files and no rank holds the whole model ([Note:
pretrained weights] in checkpoint/pretrained.py).
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Optional

import accelerate
import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import AutoConfig, GenerationConfig

from zeroshard.checkpoint import load_pretrained

from .options import Options

# what a model folder holds besides the weights (a hub download fetches these and the safetensors files)
_FOLDER_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py"]
# from_pretrained's keywords that say where the files are (the rest go to the config, then the model)
_HUB_KEYS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "subfolder")


def from_pretrained(auto_class, name_or_path: str, *, zeroshard: Optional[dict] = None, peft_config=None, **kwargs):
    """``auto_class.from_pretrained(name_or_path, **kwargs)`` for a sharded run.

    The model is built on meta (its buffers, such as rotary frequencies, by its own
    code on CPU), wrapped as ``zeroshard=dict(stage=..., ...)`` says (``Options``'
    keys; stage 3: a ``FullyShard`` over the units ``_no_split_modules`` names) and
    loaded from the folder's safetensors files, each rank reading only the elements
    it holds. Returns the ``FullyShard`` at stage 3 (give it to ``ZeroShardTrainer``
    with the same options), the loaded model at stages 1 and 2. Collective at stage
    3 (the wrap); call it on every rank. Keys the files lack or the model lacks are
    warned about, as ``from_pretrained`` does. The parameters are fp32 unless
    ``dtype=`` says otherwise (``"auto"``: the config's dtype); at stage 3 the shards
    are fp32 either way and ``mixed_precision`` in the options sets the gather dtype.

    ``peft_config`` (a peft ``LoraConfig``, ...): the model is wrapped by
    ``peft.get_peft_model`` before sharding, its adapter made by peft's own
    initialisation on CPU (the global RNG: seed first) while the base stays on meta
    until its shards are read; the base model is frozen, as peft leaves it."""
    opts = Options.parse(zeroshard, "from_pretrained")
    opts.trainer_only("from_pretrained")
    hub = {k: kwargs.pop(k) for k in _HUB_KEYS if k in kwargs}
    folder = _folder(name_or_path, hub)
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    config, model_kwargs = AutoConfig.from_pretrained(
        folder,
        return_unused_kwargs=True,
        trust_remote_code=kwargs.get("trust_remote_code", False),
        **{k: v for k, v in kwargs.items() if k != "trust_remote_code"},
    )
    if dtype == "auto":
        dtype = getattr(config, "dtype", None)
    if dtype is not None:
        model_kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with accelerate.init_empty_weights(include_buffers=False):
        model = auto_class.from_config(config, **model_kwargs)
    model.tie_weights()  # one parameter for tied names (read once)
    model.eval()  # as from_pretrained returns it
    if getattr(model, "can_generate", lambda: False)() and os.path.isfile(
        os.path.join(folder, "generation_config.json")
    ):
        model.generation_config = GenerationConfig.from_pretrained(folder)
    key_map, adapter = None, set()
    home = _home(opts.stage)
    if peft_config is not None:
        model, key_map, adapter = _with_adapter(model, peft_config, opts.stage, home)
    runner = model
    if opts.stage == 3:
        with warnings.catch_warnings():  # the weights come next: FullyShard's meta-init notes do not apply
            warnings.simplefilter("ignore")
            runner = opts.fully_shard(model, None, "from_pretrained")
    result = load_pretrained(runner, folder, strict=False, key_map=key_map, device=None if opts.stage == 3 else home)
    _report(model, folder, result, adapter)
    return runner


def _home(stage: int) -> torch.device:
    """Where the loaded model computes: this rank's GPU where there is one (at stage 3 with
    NCCL only, where FullyShard puts a model built on meta), else the CPU."""
    gpu = torch.cuda.is_available() and (stage < 3 or dist.get_backend() not in ("gloo", "fake"))
    return torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")


def _with_adapter(model: nn.Module, peft_config, stage: int, home: torch.device):
    """``get_peft_model`` over the model on meta: (the peft model, its names -> the
    files' names, the adapter's parameter names). peft puts a new adapter on its base
    layer's device (meta); its layers are made again on CPU, initialised by peft's
    ``reset_lora_parameters``, in module order (the same values on every machine), and
    moved to ``home``, where the base model's weights will be."""
    import peft

    base = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    base.update({id(b): n for n, b in model.named_buffers(remove_duplicate=False)})
    wrapped = peft.get_peft_model(model, peft_config)
    key_map = {
        n: base[id(t)]
        for n, t in list(wrapped.named_parameters(remove_duplicate=False))
        + list(wrapped.named_buffers(remove_duplicate=False))
        if id(t) in base
    }
    adapter = {n for n, p in wrapped.named_parameters() if id(p) not in base}
    if getattr(peft_config, "use_dora", False):
        raise ValueError(
            "from_pretrained(peft_config=...): DoRA's magnitude vector is computed from the base "
            "weights, which are not loaded yet; load with use_dora=False, or at stage 1/2 apply "
            "get_peft_model to the loaded model"
        )
    init = getattr(peft_config, "init_lora_weights", True)
    for mod in wrapped.modules():
        reset = getattr(mod, "reset_lora_parameters", None)
        if reset is None:
            continue
        for name in list(getattr(mod, "lora_A", {}).keys()):
            for layer in mod.adapter_layer_names:
                part = getattr(mod, layer, None)
                if part is not None and name in part and any(p.is_meta for p in part[name].parameters()):
                    part[name] = part[name].to_empty(device="cpu")
            reset(name, init)
            for layer in mod.adapter_layer_names:
                part = getattr(mod, layer, None)
                if part is not None and name in part and not any(p.is_meta for p in part[name].parameters()):
                    part[name] = part[name].to(home)
    meta = sorted(n for n in adapter if dict(wrapped.named_parameters())[n].is_meta)
    if meta:
        raise ValueError(
            f"from_pretrained(peft_config=...): the adapter parameters {meta[:4]} were left on meta "
            f"(an adapter type zeroshard does not make on CPU); at stage {stage} use LoRA, or load "
            "the model first (stage 1/2) and apply get_peft_model to it"
        )
    return wrapped, key_map, adapter


def _folder(name_or_path: str, hub: dict) -> str:
    """A local folder of the model: the path itself, or the hub snapshot (every rank
    downloads through the hub's cache and its locks)."""
    path = os.path.join(name_or_path, hub["subfolder"]) if hub.get("subfolder") else name_or_path
    if os.path.isdir(path) or os.path.isfile(path):
        return path
    from huggingface_hub import snapshot_download

    sub = hub.pop("subfolder", None)
    local = snapshot_download(name_or_path, allow_patterns=_FOLDER_FILES, **hub)
    return os.path.join(local, sub) if sub else local


def _report(model: nn.Module, folder: str, result, adapter: set) -> None:
    """Missing and unexpected keys, less the ones the model class says to ignore and
    the adapter's (new: initialised by peft)."""
    ignore_missing = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    ignore_unexpected = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    missing = [k for k in result.missing_keys if k not in adapter and not any(re.search(p, k) for p in ignore_missing)]
    unexpected = [k for k in result.unexpected_keys if not any(re.search(p, k) for p in ignore_unexpected)]
    if missing:
        warnings.warn(
            f"from_pretrained: {folder} has no weights for {missing}: they keep their initialisation "
            "(train them before use)",
            stacklevel=3,
        )
    if unexpected:
        warnings.warn(f"from_pretrained: {folder} holds weights the model has no place for: {unexpected}", stacklevel=3)
