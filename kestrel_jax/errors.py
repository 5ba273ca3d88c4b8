"""The typed errors a user can cause (bad input, settings or checkpoints), gathered in one place so
front ends (CLI, HTTP server, engine) report them cleanly instead of crashing."""

from __future__ import annotations


def user_errors() -> tuple[type[Exception], ...]:
    from kestrel_jax.checkpoint.spec import CheckpointError
    from kestrel_jax.generate import GenerationError
    from kestrel_jax.models.config import ConfigError
    from kestrel_jax.models.image_crops import ImageError
    from kestrel_jax.prompts import PromptError
    from kestrel_jax.serving.request import RequestRejected
    from kestrel_jax.serving.skills import SettingsError
    from kestrel_jax.tokenizer import TokenizerError

    return (CheckpointError, GenerationError, ConfigError, ImageError, PromptError, TokenizerError,
            SettingsError, RequestRejected, FileNotFoundError)
