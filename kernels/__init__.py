"""Attention masks, TTT attention, and cross-entropy kernels (Triton with plain-torch fallbacks)."""
