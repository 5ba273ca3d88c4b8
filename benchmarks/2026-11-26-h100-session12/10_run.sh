# Session 12, call 10 (the command as run, on call 9's warm machine and compile cache): W1 with the
# default bucket set (a, a2), with decode_buckets=1 (b: timed out compiling its new step set, no
# result), and with the vision / prefill buckets of the W1-only runs but default decode buckets (c).
export PYTHONPATH=$PWD; FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
for run in a b a2 c; do EA=""; [ $run = b ] && EA="--engine-args decode_buckets=1"; [ $run = c ] && EA="--engine-args runner.vision_buckets=1 prefill_token_buckets=1024"; echo "### $run $EA" >> $OUT/10_w1.log; timeout 100 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads w1 $EA --out $OUT/10_w1_$run.json 2>&1 | grep -v "$FILT" >> $OUT/10_w1.log; done; grep -h "###\|engine ready\|w1:\|rror" $OUT/10_w1.log | cut -c1-200
