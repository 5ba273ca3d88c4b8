# Session 50, call 2: W1 (MD3 batch-1 decode) under XLA's concurrent command-buffer scheduling
# (--xla_gpu_command_buffer_scheduling_mode=CONCURRENT: the step's CUDA graph as a DAG of its buffer
# dependencies, so independent kernels may overlap: the region heads beside the LM head and sampler;
# with KESTREL_JAX_MERGE_IN_UP=0 attention beside the MoE up GEMM), and with
# KESTREL_JAX_DENSE_IN_ONE_ROW=1 (call 1's probe: MD3 step -10.4 us, -0.7%). Each run its own
# process and compile cache; A (defaults) first and last.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
CONC="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
for v in A B C D A2; do
  [ $SECONDS -gt 470 ] && { echo "skip W1 $v: $SECONDS s"; continue; }
  case $v in
    A|A2) ENV="KESTREL_JAX_UNUSED=0";;
    B) ENV="XLA_FLAGS=$CONC";;
    C) ENV="XLA_FLAGS=$CONC KESTREL_JAX_MERGE_IN_UP=0";;
    D) ENV="KESTREL_JAX_DENSE_IN_ONE_ROW=1";;
  esac
  env $ENV timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
    --compile-cache /tmp/cc_md3_$v --workloads w1 $ARGS --out $OUT/x/2_md3_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/2_md3_w1_$v.log
  echo "md3 W1 $v ($SECONDS s): $(grep "w1:\|rror\|nvalid\|Unknown" $OUT/x/2_md3_w1_$v.log | head -3 | cut -c1-150 | tr '\n' ' ')"
done
cd $OUT && tar czf 2_all.tgz x && rm -rf x
