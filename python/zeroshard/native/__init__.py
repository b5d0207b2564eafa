"""The compiled C++/CUDA core's bindings: the flat-buffer layout (``layout``), the
fused AdamW kernels (``kernels``), block quantization (``quant``) and the loader of
the extension module (``ext``). The collectives' bindings are in ``comm``.

May import: nothing else of zeroshard (it is the bottom layer).
"""
