"""Checkpoint I/O: validated HF safetensors reading, synthetic checkpoints, converted (orbax) params.

- `HFCheckpoint.open(path)`: local HF / internal-layout safetensors (single or sharded) ->
  inferred config + canonical tensors streamed as numpy (`iter_tensors`, `read`).
- `expected_tensors(cfg, ...)`: canonical name -> TensorSpec for any config.
- `write_synthetic_checkpoint(out_dir, cfg, seed=...)`: random checkpoint, any size, streamed.
- `save_converted` / `restore_converted` / `is_converted_checkpoint`: the model's param pytree.
"""

from kestrel_jax.checkpoint.converted import is_converted_checkpoint, restore_converted, save_converted
from kestrel_jax.checkpoint.reader import HFCheckpoint
from kestrel_jax.checkpoint.spec import CheckpointError, TensorSpec, expected_tensors, parameter_count
from kestrel_jax.checkpoint.synthetic import write_synthetic_checkpoint

__all__ = [
    "CheckpointError",
    "HFCheckpoint",
    "TensorSpec",
    "expected_tensors",
    "is_converted_checkpoint",
    "parameter_count",
    "restore_converted",
    "save_converted",
    "write_synthetic_checkpoint",
]
