"""Sharded checkpoints of the trained models (``torch.distributed.checkpoint`` on any fsspec URL),
and the ways in and out of them.

sharded.py      save, load (verified) and read whole a sharded checkpoint
writer.py       a rank's checkpoint writes: synchronous, or staged and written in the background
staging.py      host copies of a rank's state trees for background writes
state.py        what goes into a checkpoint and how it comes back: tensor trees, JSON, names, RNGs
marker.py       the publish marker (every file's size and hash), its errors, verification
integrity.py    hashing each file while DCP writes it
_dist.py        the few collectives checkpointing needs, safe without a process group
hf_export.py    a checkpoint as a Hugging Face model directory
lora_export.py  PEFT's adapter format for checkpoints that hold only LoRA adapters
gguf_import.py  a Hugging Face model directory from a GGUF file
"""
