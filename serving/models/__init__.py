"""Model and tokenizer loading: Hugging Face ids, local folders, GGUF files, the packaged demo model,
and the tiny test model builder."""
