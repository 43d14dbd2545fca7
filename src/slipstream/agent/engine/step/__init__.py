"""One engine step: the model runner, the CUDA graphs and short-prefill buckets, the
pipeline's in-flight batches, and what a step hands back (outputs, stats, load)."""
