# Session 25, call 3b (run inline, this file written afterwards as its record): after call 3's ncu
# segfault, on the same warm machine: ncu's version; one section on one case (worked: its tail
# only came back); the same with XLA_PYTHON_CLIENT_PREALLOCATE=false and --target-processes all
# (still running when the call's 300 s limit ended it, with the third command never reached).
export PYTHONPATH=$PWD; ncu --version | tail -1; timeout 100 ncu -k regex:mosaic_gpu_kernel --section SpeedOfLight python3 tools/profile_moe.py 740 2>&1 | grep -v "^$" | tail -5; echo ---; XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 ncu --target-processes all -k regex:mosaic_gpu_kernel --section SpeedOfLight python3 tools/profile_moe.py 740 2>&1 | grep -v "^$" | tail -8; echo ---; timeout 60 ncu --section SpeedOfLight python3 -c "import jax.numpy as jnp; print((jnp.ones(4)+1).sum())" 2>&1 | tail -4
