"""a4ray's code over megatron-core: its CPU shims, the model built from a Hugging Face config (shared by the
Megatron trainer and the conversion's verifier). megatron-core itself is imported only where it is used."""
