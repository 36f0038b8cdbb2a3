"""`folio bench lora`: LoRA adapters mixed in one batch, folio serve vs llama-server."""
