# Session 10, call 3: the mixed step checked against separate steps at full size (MD3, kernels on),
# Output files renamed on copy: 3_mixed_check, 3_md3_ahead8, 3_md3_ahead64_timeout (no JSON: timed out after a recompile, see log), 3_md2.
# W2 with the encode-ahead window (default 8) vs a wide one (64), MD2 W1 + W2 with the defaults.
export PYTHONPATH=$PWD:$PWD/.scratch/site
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
timeout 200 python3 tools/check_mixed_step.py --model md3 --compile-cache /tmp/ccm --out $OUT/1_mixed_check.json 2>&1 | grep -v "$FILT" > $OUT/1_mixed_check.log
EA="decode_buckets=1,64 prefill_token_buckets=2048 runner.vision_buckets=2"
B="python3 tools/benchmark.py --random-weights --requests-per-client 8 --concurrency 64 8"
timeout 150 $B --model md3 --compile-cache /tmp/cc --workloads w2 --engine-args $EA --out $OUT/2_md3_w8.json 2>&1 | grep -v "$FILT" > $OUT/2_md3_w8.log
timeout 60 $B --model md3 --compile-cache /tmp/cc --workloads w2 --engine-args $EA vision_ahead=64 --out $OUT/3_md3_w64.json 2>&1 | grep -v "$FILT" > $OUT/3_md3_w64.log
timeout 170 $B --model md2 --compile-cache /tmp/cc2 --workloads w1,w2 --w1-reps 2 --engine-args $EA --out $OUT/4_md2.json 2>&1 | grep -v "$FILT" > $OUT/4_md2.log
grep -h "tokens_equal\|row\|engine ready\|w1:\|w2 C=\|rror" $OUT/*.log | cut -c1-700 | head -40
