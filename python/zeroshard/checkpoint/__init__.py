"""Checkpoints that resume at any world size and stage: ``save_checkpoint``,
``load_checkpoint`` and ``export_full_state_dict`` (``api``), over what a rank
holds, by key (``holdings``), the save's steps (``save``), the exchange of
outcomes that ends each step of a save or load (``peers``), and the file format:
safetensors writer, manifest and verifying reader (``format``).
[Note: checkpoint format] in ``checkpoint/api.py``.

May import: ``native``, ``comm``, ``common``, ``zero3``, ``optim``.
"""
from .api import export_full_state_dict, load_checkpoint, save_checkpoint
from .format import CheckpointError

__all__ = ["CheckpointError", "export_full_state_dict", "load_checkpoint", "save_checkpoint"]
