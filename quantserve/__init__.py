"""quantserve: fine-tune, quantize and serve a language model on one T4-class GPU."""

__version__ = "0.1.0"
