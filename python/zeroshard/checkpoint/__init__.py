"""Checkpoints that resume at any world size and stage: ``save_checkpoint``,
``load_checkpoint``, ``export_full_state_dict``, ``read_full_state_dict`` and ``full_state_dict_meta`` (``api``), ``resume``
(the newest complete checkpoint under a path, at a script's start: ``resume``), over what a rank
holds, by key (``holdings``), the save's steps (``save``), the exchange of
outcomes that ends each step of a save or load (``peers``), and the file format:
safetensors writer, manifest and verifying reader (``files``); published weights read
straight into shards (``pretrained``: ``load_pretrained``); torch.distributed.checkpoint
state dicts of the same pieces (``dcp``: ``dcp_state_dict``, ``load_dcp_state_dict``).
[Note: checkpoint format] in ``checkpoint/api.py``.

May import: ``native``, ``comm``, ``core``, ``optim``.
"""

from .api import export_full_state_dict, full_state_dict_meta, load_checkpoint, read_full_state_dict, save_checkpoint
from .dcp import dcp_state_dict, load_dcp_state_dict
from .files import CheckpointError
from .pretrained import load_pretrained
from .resume import resume

__all__ = [
    "CheckpointError",
    "dcp_state_dict",
    "export_full_state_dict",
    "full_state_dict_meta",
    "load_checkpoint",
    "load_dcp_state_dict",
    "load_pretrained",
    "read_full_state_dict",
    "resume",
    "save_checkpoint",
]
