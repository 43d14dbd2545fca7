"""Attention backends behind one interface: a torch reference (CPU) and FlashInfer (GPU)."""
