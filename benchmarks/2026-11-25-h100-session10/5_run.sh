# Session 10, call 5: the MoE grouping without a sort and the FP8 row gather as 32-bit words:
# the layer kernel by kernel (as call 4), then W2 MD3 new / base (the previous commit, b2da682,
# unpacked under .scratch/base) / new.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
PYTHONPATH=$PWD timeout 120 python3 tools/probe_moe_kernels.py --tokens 1,740,1544 --out-dir $OUT 2>&1 | grep -v "$FILT" > $OUT/5_probe.log
rm -f $OUT/*.hlo.txt  # (call 4 kept them: 4_moe_t1544.hlo.txt.gz)
EA="decode_buckets=1,64 prefill_token_buckets=2048 runner.vision_buckets=2"
ARGS="--model md3 --random-weights --requests-per-client 8 --concurrency 64 8 --workloads w2 --engine-args $EA"
PYTHONPATH=$PWD:$PWD/.scratch/site timeout 160 python3 tools/benchmark.py $ARGS --compile-cache /tmp/cc --out $OUT/5_new_a.json 2>&1 | grep -v "$FILT" > $OUT/5_new_a.log
PYTHONPATH=$PWD/.scratch/base:$PWD/.scratch/site timeout 160 python3 .scratch/base/tools/benchmark.py $ARGS --compile-cache /tmp/ccb --out $OUT/5_base.json 2>&1 | grep -v "$FILT" > $OUT/5_base.log
PYTHONPATH=$PWD:$PWD/.scratch/site timeout 80 python3 tools/benchmark.py $ARGS --compile-cache /tmp/cc --out $OUT/5_new_b.json 2>&1 | grep -v "$FILT" > $OUT/5_new_b.log
head -80 $OUT/5_probe.log; grep -h "engine ready\|w2 C=\|rror" $OUT/5_*.log | cut -c1-400
