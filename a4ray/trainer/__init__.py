"""a4ray's built-in trainer: `python -m a4ray.trainer` under torchrun (the `torch` trainer of the recipes).

`train` is the loop, `data` what it reads (Megatron .bin/.idx, SFT JSON), `checkpoint` what it writes.
"""
