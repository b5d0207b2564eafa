"""DeepSpeed's ``zero_to_fp32`` under zeroshard's name, for checkpoints written by
``zeroshard.initialize``'s engine: ``get_fp32_state_dict_from_zero_checkpoint``,
``convert_zero_checkpoint_to_fp32_state_dict``, ``load_state_dict_from_zero_checkpoint``,
and the command line

    python -m zeroshard.zero_to_fp32 CHECKPOINT_DIR OUTPUT [-t TAG]

A thin module: the code is in ``zeroshard.integrations.deepspeed.zero_to_fp32``.
"""

from zeroshard.integrations.deepspeed.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]

if __name__ == "__main__":
    main()
