import sys

from kestrel_jax.cli import main

sys.exit(main())
