# Session 44, call 2 (H200): call 1's check of KESTREL_JAX_GEMV_DENSE_OUT=4 against XLA gave MD2 final
# hidden states max_rel 0.71 / 0.50 / 0.54 at 64 / 8 / 2 rows (MD3: 0.077). Is that the kernel or
# 24 random layers amplifying last-bit differences? check_decode_fusion --layers: one MD2 layer, the
# kernel against XLA and against itself at 8 splits (summation order only); all 24 layers at 4
# against 8 splits (how much depth amplifies a pure rounding difference); MD3's four dense layers.
# Then MD3 W2 C=64, default then the switch on (cold caches each), if the checks leave time.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
chk() { tag=$1; shift; timeout 120 python3 tools/check_decode_fusion.py --fused-dense-decode --out $OUT/x/2_check_$tag.json "$@" 2>&1 \
  | grep -v "$FILT" > $OUT/x/2_check_$tag.log; echo "check $tag ($SECONDS s):"; grep '^{' $OUT/x/2_check_$tag.log; grep -i "error" $OUT/x/2_check_$tag.log | head -3; }
chk md2_l1 --model md2 --layers 1 --switch KESTREL_JAX_GEMV_DENSE_OUT=4,0 KESTREL_JAX_GEMV_DENSE_OUT=4,8 --batches 64 8
chk md2_l24 --model md2 --switch KESTREL_JAX_GEMV_DENSE_OUT=4,8 --batches 64
chk md3_l4 --model md3 --layers 4 --switch KESTREL_JAX_GEMV_DENSE_OUT=4,0 --batches 64
W2ARGS="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for v in 0 4; do
  [ $SECONDS -gt 330 ] && { echo "skip md3 $v: $SECONDS s"; continue; }
  KESTREL_JAX_GEMV_DENSE_OUT=$v timeout $((580 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
    --compile-cache /tmp/cc_md3_$v --workloads w2 $W2ARGS --out $OUT/x/2_md3_out$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/2_md3_out$v.log
  echo "md3 out=$v ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/2_md3_out$v.log | cut -c1-140 | tr '\n' ' ')"
done
cd $OUT && gzip x/2_md*.json; tar czf 2_all.tgz x && rm -rf x
