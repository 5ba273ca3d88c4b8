# Session 11, call 2: where the prefill (2 x 740 tokens in the 2048 bucket), mixed (that + 64 decode
# rows) and decode (64 rows) steps spend their time, kernel by kernel, with their optimized HLO; then
# MD3 W1 and W2 C=64 with the defaults (vision bucket 1), and a second process with vision bucket 2,
# which must now load the first process's exported steps (their salt no longer holds settings that do
# not shape the text steps; call 1's alternating runs re-exported every time).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
timeout 200 python3 tools/probe_step_kernels.py --model md3 --kinds prefill,mixed,decode --out-dir $OUT > $OUT/2_steps.log 2>&1
ARGS="--model md3 --random-weights --requests-per-client 8 --concurrency 64 --compile-cache /tmp/cc"
timeout 200 python3 tools/benchmark.py $ARGS --workloads startup,w1,w2 --engine-args decode_buckets=1,64 prefill_token_buckets=2048 runner.vision_buckets=1 --out $OUT/2_md3.json 2>&1 | grep -v "$FILT" > $OUT/2_md3.log
echo "### vb2 start-up" >> $OUT/2_md3.log
timeout 80 python3 tools/benchmark.py $ARGS --workloads startup --engine-args decode_buckets=1,64 prefill_token_buckets=2048 runner.vision_buckets=2 --out $OUT/2_warm_vb2.json 2>&1 | grep -v "$FILT" >> $OUT/2_md3.log
grep -v "^   " $OUT/2_steps.log | tail -5; grep -h "###\|engine ready\|w1:\|w2 C=\|rror" $OUT/2_md3.log | cut -c1-300; grep -o "'export_steps': {[^}]*}" $OUT/2_md3.log
