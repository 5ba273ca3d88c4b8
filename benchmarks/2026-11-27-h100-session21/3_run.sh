# Session 21, call 3 (call 2 again with the side-stream function traced flat: nested jitted calls inlined, since XLA failed at run time on nested annotated calls): the MoE expert rows (KESTREL_JAX_MOE_STREAM=1) or the attention + output
# projection (KESTREL_JAX_ATTN_STREAM=1) of each decode layer on a second GPU stream
# (compute_on("gpu_stream:1")), so the two branches of a parallel block can overlap. Full-size
# forward on vs off at 1 row; W1 default / MoE stream / attention stream (wall clock: the probe's
# CUPTI sums cannot show overlap); whether the optimized HLO has the async pair; then, time left,
# the batch-1 step with the decode attention unsplit (KESTREL_JAX_DECODE_SPLITS=1, no merge launch).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 150 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_MOE_STREAM KESTREL_JAX_ATTN_STREAM --batches 1 \
  --out $OUT/x/3_check.json 2>&1 | grep -v "$FILT" > $OUT/x/3_check.log
tail -4 $OUT/x/3_check.log
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
i=0
for v in none MOE ATTN; do
  i=$((i+1))
  env=""; [ $v != none ] && env="KESTREL_JAX_${v}_STREAM=1"
  env $env XLA_FLAGS="--xla_dump_to=/tmp/dump_$v --xla_dump_hlo_module_re=.*decode.*" timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$i --engine-args $EA --out $OUT/x/3_w1_${i}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/3_w1_${i}_$v.log
  echo "run $i stream=$v: $(grep "batch-1 decode tok/s\|rror" $OUT/x/3_w1_${i}_$v.log | head -3 | tr '\n' ' ')"
  f=$(ls -S /tmp/dump_$v/*after_optimizations.txt 2>/dev/null | head -1)
  echo "  $f: async-start $(grep -c 'async-start\|call-start' $f 2>/dev/null) stream-annot $(grep -c '_xla_stream_annotation' $f 2>/dev/null)"
  [ $v = MOE ] && grep -m3 "async-start\|call-start" $f | cut -c1-300
done
left=0
echo "left $left s"
if [ $left -gt 90 ]; then
  timeout $left python3 tools/probe_step_kernels.py --kernels 10 --model md3 --kinds decode --batch 1 \
    --ab KESTREL_JAX_DECODE_SPLITS=4,1 --json $OUT/x/3_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/3_probe_splits.log
  grep -A8 "^decode:" $OUT/x/3_probe_splits.log
fi
cd $OUT && tar czf 3_all.tgz x && rm -rf x
