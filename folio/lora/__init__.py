"""LoRA adapters: PEFT folders read and matched to a model's layers, and the runner's store of them."""
