"""hf-ao-publish: quantize a Hugging Face model with torchao, verify it, card it, publish it."""

__version__ = "0.1.0"
