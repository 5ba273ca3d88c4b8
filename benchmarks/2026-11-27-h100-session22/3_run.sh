# Session 22, call 3: the experts' L2 prefetch from decode attention, where and how much
# (KESTREL_JAX_L2_PREFETCH: 2 = all selected experts' up rows at each CTA's start, +4 once its own
# loads are consumed, +8 only the first half of each expert's rows). Batch-1 step A/B (CUPTI +
# wall) at 0 / 2 / 6 / 10 / 14, then W1 at the best wall and at 0.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 280 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode --batch 1 \
  --ab KESTREL_JAX_L2_PREFETCH=0,2,6,10,14 --json $OUT/x/3_probe1.json 2>&1 | grep -v "$FILT" > $OUT/x/3_probe1.log
grep "^\[" $OUT/x/3_probe1.log
grep -A8 "^decode:" $OUT/x/3_probe1.log | head -60
BEST=$(python3 -c "
import json,glob
r={f.split('=')[-1][:-5]: json.load(open(f))['steps']['decode']['wall_us'] for f in glob.glob('$OUT/x/3_probe1_*.json')}
print(min((v,k) for k,v in r.items() if k!='0')[1])")
echo "best wall: $BEST"
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
i=0
for s in $BEST 0; do
  i=$((i+1))
  KESTREL_JAX_L2_PREFETCH=$s timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$i --engine-args $EA --out $OUT/x/3_w1_${i}_pf$s.json 2>&1 | grep -v "$FILT" > $OUT/x/3_w1_${i}_pf$s.log
  echo "run $i prefetch=$s: $(grep "batch-1 decode tok/s\|rror" $OUT/x/3_w1_${i}_pf$s.log | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 3_all.tgz x && rm -rf x
