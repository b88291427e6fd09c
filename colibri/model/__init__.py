"""The model layer: forward passes per architecture, sampling, tokenizer and chat template."""
