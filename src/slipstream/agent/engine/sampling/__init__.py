"""Turning logits into tokens: sampling parameters, the sampler and grammar masks."""
