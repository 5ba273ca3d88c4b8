# Session 10, call 6: as call 5 after the regression it found (the combine recomputed the sort-free
# ranks per element; the grouping maps are now materialised): the layer kernel by kernel, W2 MD3 new / base.
# (base = commit b2da682 unpacked under .scratch/base)
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
PYTHONPATH=$PWD timeout 120 python3 tools/probe_moe_kernels.py --tokens 740,1544 --out-dir $OUT 2>&1 | grep -v "$FILT" > $OUT/6_probe.log
rm -f $OUT/*.hlo.txt  # (call 4 kept them: 4_moe_t1544.hlo.txt.gz)
# the W2 runs only if the layer is no longer slower than call 4's 469 us at T = 1544
python3 -c "import json,sys; t=json.load(open('$OUT/moe_kernels.json'))['cases']['1544']['total_us']; print('T=1544 total', t); sys.exit(t > 469)" || { cat $OUT/6_probe.log; exit 1; }
EA="decode_buckets=1,64 prefill_token_buckets=2048 runner.vision_buckets=2"
ARGS="--model md3 --random-weights --requests-per-client 8 --concurrency 64 8 --workloads w2 --engine-args $EA"
PYTHONPATH=$PWD:$PWD/.scratch/site timeout 160 python3 tools/benchmark.py $ARGS --compile-cache /tmp/cc --out $OUT/6_new_a.json 2>&1 | grep -v "$FILT" > $OUT/6_new_a.log
PYTHONPATH=$PWD/.scratch/base:$PWD/.scratch/site timeout 160 python3 .scratch/base/tools/benchmark.py $ARGS --compile-cache /tmp/ccb --out $OUT/6_base.json 2>&1 | grep -v "$FILT" > $OUT/6_base.log
head -80 $OUT/6_probe.log; grep -h "engine ready\|w2 C=\|rror" $OUT/6_*.log | cut -c1-400
