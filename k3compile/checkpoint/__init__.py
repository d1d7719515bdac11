"""Checkpoint I/O: safetensors reading by slice, mxfp4 experts, model generation."""
