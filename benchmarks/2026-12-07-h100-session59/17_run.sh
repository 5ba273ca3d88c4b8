# Session 59 call 4, one plan per card: an H200 runs the pending 1a_run.sh (issue 6's MD3 / MD2 W1 on the
# card its targets name); an H100 runs the FP8 decode GEMM cases call 2 did not reach (the LM head and
# the output projection through the MoE's grouped GEMM, W8A8, against the bf16 default), 1 row.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $G"
case "$G" in
  *H200*) bash benchmarks/pending/1a_run.sh ;;
  *) nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/17_env.txt
     timeout 330 python3 tools/bench_decode_gemm.py --rows 1 --layers 16 --budget-s 240 \
       --shapes lm_head,proj --variants default,mgpu_w8a8 --out $OUT/17_decode_gemm.json 2>&1 \
       | grep -v "$FILT" > $OUT/17_decode_gemm.log
     grep -v "^ \|Traceback\|^  File" $OUT/17_decode_gemm.log | cut -c1-160 ;;
esac
