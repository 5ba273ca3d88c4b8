# Session 50, call 6 (the last device minutes): the one-launch QKV epilogue + attention's splits and
# warps (call 5: 11.83 us per MD2 layer at the defaults, 16 splits and 4 warps, against 5.55 + 1.92).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
S="KESTREL_JAX_QKV_ATTENTION=1+KESTREL_JAX_QKV_ATTENTION"
timeout 100 python3 tools/probe_step_kernels.py --kernels 8 --top 4 --model md2 --kinds decode --batch 1 \
  --sets ${S}_SPLITS=4 ${S}_SPLITS=8 ${S}_WARPS=8 ${S}_SPLITS=4+KESTREL_JAX_QKV_ATTENTION_WARPS=2 \
  --json $OUT/x/6_probe_md2.json 2>&1 | grep -v "$FILT" > $OUT/x/6_probe_md2.log
echo "probe ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|x24  kestrel_decode_qkv_attention" $OUT/x/6_probe_md2.log | cut -c1-150
cd $OUT && tar czf 6_all.tgz x && rm -rf x
