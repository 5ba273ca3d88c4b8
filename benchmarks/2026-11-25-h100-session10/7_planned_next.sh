# Planned for the next GPU session, not run here (device time spent): the default engine's start-up
# with the W2 bucket set (threaded compile, cold then warm; num_pages must be equal in both
# processes after this session's sizing fix), then W1 and W2 (C=64, 32, 8) with this session's
# defaults on MD3; and where the prefill, mixed and decode steps spend their time, kernel by kernel,
# with their optimized HLO (tools/probe_step_kernels.py: the W2 trace shows ~435 ms of every 2 s in
# elementwise and glue fusions inside the steps; this names them). Vision bucket 1: the one-crop
# encoding of 1x1 tilings (landed at the end of session 10, not measured on a GPU yet; compare
# with runner.vision_buckets=2 in the same call).
export PYTHONPATH=$PWD:$PWD/.scratch/site
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
EA="decode_buckets=1,8,16,32,64 prefill_token_buckets=1024,2048 runner.vision_buckets=1"
rm -rf /tmp/cc
timeout 260 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads startup,w1,w2 --concurrency 64 32 8 --engine-args $EA --out $OUT/1_md3.json 2>&1 | grep -v "$FILT" > $OUT/1_md3.log
timeout 60 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads startup --engine-args $EA --out $OUT/2_md3_warm.json 2>&1 | grep -v "$FILT" > $OUT/2_md3_warm.log
PYTHONPATH=$PWD timeout 180 python3 tools/probe_step_kernels.py --model md3 --kinds prefill,mixed,decode --out-dir $OUT > $OUT/3_steps.log 2>&1
grep -h "engine ready\|num_pages\|w1:\|w2 C=\|rror" $OUT/*.log | cut -c1-600
