"""Integrations of mok with other libraries.

mok.integrations.huggingface: swap the sparse MoE blocks of a Hugging Face transformers model in
place for mok's fused layer (needs the `hf` extra: transformers >= 5.17, < 6).
"""
