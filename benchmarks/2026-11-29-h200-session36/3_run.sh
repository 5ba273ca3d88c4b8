# Session 36, call 3 (H200): call 2 measured the joined output projection + fc2 product at -142 us per
# MD2 64-row decode step and MD2 W2 +1.2% (three alternations, 9,510 -> 9,623 mean); now the default
# (KESTREL_JAX_DENSE_OUT_JOINED=0 turns it off, read when the runner joins the weights). With the wide
# QKV read on top, the probe showed -43 us more. (1) MD3 decode step at 64 rows, output join off / on
# (two processes: its dense first four layers); (2) MD2 W2 C=64 default / + wide QKV read, alternated.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
for j in 0 1; do
  timeout 120 env KESTREL_JAX_DENSE_OUT_JOINED=$j python3 tools/probe_step_kernels.py --kernels 30 --top 30 --model md3 \
    --kinds decode --batch 64 --context 800 --wall-rounds 3 --json $OUT/x/3_probe_md3_out$j.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/3_probe_md3_out$j.log
  echo "probe md3 out=$j ($SECONDS s): $(grep "launches (\|rror" $OUT/x/3_probe_md3_out$j.log | cut -c1-160)"
done
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for f in def wide def wide def wide; do
  i=$((i+1))
  [ $SECONDS -gt 500 ] && { echo "skip run $i ($f): $SECONDS s"; continue; }
  if [ $f = wide ]; then E="env KESTREL_JAX_DECODE_QKV_WIDE=1"; else E=env; fi
  timeout $((585 - SECONDS)) $E python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$f --workloads w2 $W2 --out $OUT/x/3_${i}_md2_$f.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/3_${i}_md2_$f.log
  echo "run $i $f ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/3_${i}_md2_$f.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
cd $OUT && gzip x/3_*_md2_*.json; tar czf 3_all.tgz x && rm -rf x
