# Session 43, call 1 (H200): issue 3's whole decode grid (B in 1, 4, 8, 32, 64, 128 x KV in 128, 512,
# 740, 1024, 2048, 4096; FP8 pages of 64 tokens), each case beside the XLA reference and, at
# KERNELS.md's reference points, the stock Triton kernel; then the prefill and KV-write cases. No
# tuning sweeps (--budget-s 1). The JSON is rewritten after every case, so a run cut short by the
# call's limit keeps what it measured (the rest goes to the next call through --decode-cases).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 560 python3 tools/bench_attention.py --budget-s 1 --out $OUT/x/1_attention.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_attention.log
echo "grid rc $? ($SECONDS s)"
grep "^decode\|^prefill\|^write\|rror" $OUT/x/1_attention.log | cut -c1-300
tail -45 $OUT/x/1_attention.log | cut -c1-260
cd $OUT && tar czf 1_all.tgz x && rm -rf x
