"""LoRA adapters served beside their base model: many fine-tunes in one running batch.

`files` reads and checks an adapter as mlx-lm's `mlx_lm.lora` writes it; `layers` holds
the batched LoRA layer (`mx.gather_mm` picks each row's adapter) and the cache entry
that keeps each row's adapter slot in step with the batch; `bank` decides which
adapters are loaded, which sit in the layers' slots, and who uses them.
"""

from worker.engine.adapters.bank import AdapterBank, UnknownAdapter
from worker.engine.adapters.files import AdapterRefused

__all__ = ["AdapterBank", "AdapterRefused", "UnknownAdapter"]
