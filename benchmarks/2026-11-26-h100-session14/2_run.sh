# Session 14, call 2: the default decode bucket set's batch-1 gap is device-side (call 1: the engine
# thread waits for outputs 87% of the time in both engines). Where does the GPU idle? W1 traces of
# pure batch-1 decode with the idle gaps by length and neighbouring kernels, for decode_buckets=1
# and the full set; and the full set with XLA command buffers off.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
for run in dall_nocb d1_trace dall_trace; do
  F=""; TR=""
  case $run in d1*) B=1; T=130;; *) B=1,2,4,8,16,32,48,64; T=230;; esac
  case $run in *nocb) F="--xla_gpu_enable_command_buffer=";; esac
  case $run in *trace) TR="--trace-dir /tmp/tr_$run";; esac
  XLA_FLAGS="$F" timeout $T python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_$run \
    --workloads w1 $TR --engine-args decode_buckets=$B prefill_token_buckets=1024 runner.vision_buckets=1 \
    "runner.vision_image_batches=()" --out $OUT/2_w1_$run.json 2>&1 | grep -v "$FILT" > $OUT/2_w1_$run.log
done
grep -h "w1:\|trace w1\|rror" $OUT/2_w1_*.log | cut -c18-1500
