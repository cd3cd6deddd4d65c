"""asyncgrpo: asynchronous RL post-training of LLMs (async GRPO), configured with Hydra.

Importing this package is cheap: it must never import torch, transformers or vLLM.
"""

__version__ = "0.1.0"
