# Session 20, call 2: the routing tables in the QKV epilogue (now default on) at the larger decode
# buckets: full-size forward on vs off at 8 and 64 rows (bit-identity), the 64-row decode step
# kernel by kernel on vs off; then the batch-1 step with the fused residual + LayerNorm kernel
# (KESTREL_JAX_DECODE_RESIDUAL=1, off since the seventh session, measured slower then) vs without.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 100 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_ROUTE_IN_QKV --batches 8 64 \
  --out $OUT/x/2_check.json 2>&1 | grep -v "$FILT" > $OUT/x/2_check.log
tail -2 $OUT/x/2_check.log
for rq in 1 0; do
  KESTREL_JAX_ROUTE_IN_QKV=$rq timeout 90 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode \
    --batch 64 --json $OUT/x/2_probe64_rq$rq.json 2>&1 | grep -v "$FILT" > $OUT/x/2_probe64_rq$rq.log
  echo "batch 64 route_in_qkv=$rq: $(head -1 $OUT/x/2_probe64_rq$rq.log)"
done
for dr in 1 0; do
  KESTREL_JAX_DECODE_RESIDUAL=$dr timeout 90 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode \
    --batch 1 --json $OUT/x/2_probe1_dr$dr.json 2>&1 | grep -v "$FILT" > $OUT/x/2_probe1_dr$dr.log
  echo "batch 1 decode_residual=$dr: $(head -1 $OUT/x/2_probe1_dr$dr.log)"
done
python3 tools/diff_step_kernels.py $OUT/x/2_probe64_rq0.json $OUT/x/2_probe64_rq1.json 2>&1 | head -30 > $OUT/x/2_diff64.txt
python3 tools/diff_step_kernels.py $OUT/x/2_probe1_dr0.json $OUT/x/2_probe1_dr1.json 2>&1 | head -30 > $OUT/x/2_diff1.txt
cat $OUT/x/2_diff64.txt $OUT/x/2_diff1.txt
cd $OUT && tar czf 2_all.tgz x && rm -rf x
