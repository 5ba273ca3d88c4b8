# Session 36, call 2 (H200): call 1 found the wide QKV read -37 us per MD2 64-row decode step and the
# in-place mixed output -33 us per mixed step, but MD2 W2 -1.0% with both (two alternations).
# New (opt-in, KESTREL_JAX_DENSE_OUT_JOINED=1): a dense layer's decode output projection and fc2 as
# one product over their weights joined at load ([proj; fc2], K = 2048 + 8192), attention's output
# and GELU(fc1) side by side: one split-K GEMM and one partial-sum pass instead of two of each.
# (1) MD2 decode step at 64 rows: default / joined out / joined out + wide QKV read; (2) MD2 W2 C=64
# default / joined out, alternated (own compile caches).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
J=KESTREL_JAX_DENSE_OUT_JOINED=1
W=KESTREL_JAX_DECODE_QKV_WIDE=1
timeout 150 python3 tools/probe_step_kernels.py --kernels 30 --top 30 --model md2 --kinds decode \
  --batch 64 --context 800 --wall-rounds 3 --sets default $J $J+$W \
  --json $OUT/x/2_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/2_probe.log
echo "probe ($SECONDS s):"; grep "launches (\|rror" $OUT/x/2_probe.log | cut -c1-200
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for f in def out def out def out; do
  i=$((i+1))
  [ $SECONDS -gt 500 ] && { echo "skip run $i ($f): $SECONDS s"; continue; }
  if [ $f = out ]; then E="env $J"; else E=env; fi
  timeout $((585 - SECONDS)) $E python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$f --workloads w2 $W2 --out $OUT/x/2_${i}_md2_$f.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/2_${i}_md2_$f.log
  echo "run $i $f ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/2_${i}_md2_$f.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
cd $OUT && gzip x/2_*_md2_*.json; tar czf 2_all.tgz x && rm -rf x
