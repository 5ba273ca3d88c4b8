# Session 36, call 1 (H200): two opt-in switches built at the end of session 35, not yet measured:
# KESTREL_JAX_DECODE_QKV_WIDE=1 (the decode QKV epilogue kernel reads the QKV columns of the joined
# QKV + fc1 product in place of XLA's copy) and KESTREL_JAX_MIXED_OUT_IN_PLACE=1 (the mixed step's
# decode rows written into the prefill attention kernel's output instead of a concatenation).
# (1) MD2 decode and mixed steps at 64 rows, four variants in one process; (2) MD2 W2 C=64
# default / both / default / both (own compile caches).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
W=KESTREL_JAX_DECODE_QKV_WIDE=1
M=KESTREL_JAX_MIXED_OUT_IN_PLACE=1
timeout 200 python3 tools/probe_step_kernels.py --kernels 30 --top 30 --model md2 --kinds decode,mixed \
  --batch 64 --context 800 --wall-rounds 3 --sets default $W $M $W+$M \
  --json $OUT/x/1_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/1_probe.log
echo "probe ($SECONDS s):"; grep "launches (\|rror" $OUT/x/1_probe.log | cut -c1-200
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for f in def both def both; do
  i=$((i+1))
  [ $SECONDS -gt 470 ] && { echo "skip run $i ($f): $SECONDS s"; continue; }
  if [ $f = both ]; then E="env $W $M"; else E=env; fi
  timeout $((585 - SECONDS)) $E python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$f --workloads w2 $W2 --out $OUT/x/1_${i}_md2_$f.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/1_${i}_md2_$f.log
  echo "run $i $f ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/1_${i}_md2_$f.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
cd $OUT && gzip x/1_*_md2_*.json; tar czf 1_all.tgz x && rm -rf x
