"""The benchmarks' GPT: the training example's model (examples/train_gpt.py:
token + position embeddings, pre-norm blocks of causal self-attention and
MLP, tied output head), with the benchmarks' default sizes."""

from dataclasses import dataclass

from benchmarks import harness  # noqa: F401  (puts examples/ on sys.path)
from train_gpt import GPT, Block, GPTConfig as _ExampleConfig  # noqa: E402


@dataclass
class GPTConfig(_ExampleConfig):  # seq 64, 4 layers, 4 heads as the example's
    vocab: int = 1021
    dim: int = 256


__all__ = ["GPT", "Block", "GPTConfig"]
