"""kestrel_jax: a JAX/Pallas inference engine for the Moondream vision-language models."""

from kestrel_jax import xla_defaults as _xla_defaults

_xla_defaults.apply()  # before JAX starts its backend (see xla_defaults.py)
