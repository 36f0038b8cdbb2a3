"""The engines folio is measured beside: Hugging Face transformers, and llama.cpp (built from the llama-
cpp-python sdist: llama-bench, llama-batched-bench, llama-server)."""
