"""Serving: SGLang client and launcher, the CPU engine, model and tokenizer loading."""
