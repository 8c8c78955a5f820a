"""DeepSpeed-native pretraining and GRPO for Mixture-of-Experts language models (see README.md)."""
import logging


class _Drop(logging.Filter):
    """Drops a logger's records whose message holds `text`; every other record of that logger still shows."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


# torchao (the fp8 and test extras) is imported by transformers whenever it is installed, so every program printed
# four lines on start: torchao's CUDA extensions for MX formats and CUTLASS failing to load (the engine's FP8 runs on
# torch's scaled GEMMs and Triton, not on those), and torch 2.13's deprecation of the pytree registration of two of
# torchao's Enums. Exactly those messages are dropped, at their loggers, before either module is imported.
logging.getLogger("torchao").addFilter(_Drop("Failed to load "))
logging.getLogger("torch.utils._pytree").addFilter(_Drop("is an Enum subclass and is now natively supported"))
