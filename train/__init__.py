"""Pre-training a Llama with SageBwd attention: `python -m train --preset tiny`.

One idea per module, read in this order: config (flags and presets), data
(byte tokens, split, batches as a function of (seed, step)), optim (AdamW),
step (the jitted train step), checkpoint (orbax), metrics (JSONL), loop (the
loop itself), plot (loss curves).
"""

from train.config import Config, preset

__all__ = ["Config", "preset"]
