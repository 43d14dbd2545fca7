"""The PyTorch engine: model, loader, tokenizer, paged KV cache, model runner, engine loop."""
