# Session 31, call 4 (H200, ~4 minutes of device time left): call 3 showed the vision step's
# command-buffer update at 0.84 ms with XLA attention against 1.7-2.0 ms with cuDNN's (and W2 -6.6%
# with XLA's slower attention). Can the cuDNN attention stay and its update go? The one-crop vision
# step (MD2 encoder, random weights) compiled with XLA's per-program xla_gpu_enable_command_buffer
# option: the default types, all but CUDNN (the cuDNN calls run outside the graph), and none;
# host time per launch (device idle, buffers rotated) and back-to-back step time, in one process.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 140 python3 tools/bench_vision_batch.py --model md2 --images 1 4 --launch --iters 10 --reps 3 \
  --variants default nocudnn=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL off= --out $OUT/x/4_vision_cb.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/4_vision_cb.log
grep "variant\|rror" $OUT/x/4_vision_cb.log | cut -c1-400
cd $OUT && tar czf 4_all.tgz x && rm -rf x
