# Session 38, call 3 (H200): the fused fc1 + GELU kernel now on by default with 4 stages (call 2:
# MD2 prefill step -2.5%, mixed -0.5%, MD2 W2 unchanged). MD3's four dense layers take it too:
# (1) probe MD3 prefill + mixed steps, default / off; (2) MD3 W2 C=64 on / off alternated.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
timeout 200 python3 tools/probe_step_kernels.py --kernels 30 --top 30 --model md3 --kinds prefill,mixed \
  --tokens 1536 --prompt 740 --batch 64 --context 800 --wall-rounds 3 --sets default KESTREL_JAX_LINEAR_GELU=0 \
  --json $OUT/x/3_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/3_probe.log
echo "probe ($SECONDS s):"; grep "launches (\|rror\|linear_gelu" $OUT/x/3_probe.log | cut -c1-200 | head -12
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for f in on off on off; do
  i=$((i+1))
  [ $SECONDS -gt 440 ] && { echo "skip run $i ($f): $SECONDS s"; continue; }
  if [ $f = off ]; then E="env KESTREL_JAX_LINEAR_GELU=0"; else E=env; fi
  timeout $((535 - SECONDS)) $E python3 tools/benchmark.py --model md3 --random-weights \
    --compile-cache /tmp/cc_md3_$f --workloads w2 $W2 --out $OUT/x/3_${i}_md3_$f.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/3_${i}_md3_$f.log
  echo "run $i $f ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/3_${i}_md3_$f.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
cd $OUT && gzip x/3_*_md3_*.json x/3_probe*.json 2>/dev/null; tar czf 3_all.tgz x && rm -rf x
