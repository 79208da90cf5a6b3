"""Native Flax model definitions (LLaMA, GPT-J, OPT, T5) with Hugging Face checkpoint import/export."""
