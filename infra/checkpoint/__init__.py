"""Sharded checkpoints of the trained models (``torch.distributed.checkpoint`` on any fsspec URL)
and their export to a Hugging Face directory."""
