# Session 17, call 3: why the LayerNorm kernel made W1 slower (call 2: 616.7 / 618.4 tok/s on vs
# 630.1 off): the batch-1 step probed kernel by kernel with it off, on (4 warps) and on with 16
# warps, each with its optimized HLO.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
P="timeout 80 python3 tools/probe_step_kernels.py --kernels 40 --model md3 --kinds decode --batch 1"
for run in off on w16; do
  mkdir -p /tmp/pd_$run
  case $run in off) export KESTREL_JAX_LN_KERNEL=0;; on) unset KESTREL_JAX_LN_KERNEL;; w16) export KESTREL_JAX_LN_WARPS=16;; esac
  $P --out-dir /tmp/pd_$run --json /tmp/pd_$run/d1.json > $OUT/3_probe_$run.log 2>&1
  cp /tmp/pd_$run/step_decode.hlo.txt.gz $OUT/3_step_decode_$run.hlo.txt.gz 2>/dev/null
done
unset KESTREL_JAX_LN_KERNEL KESTREL_JAX_LN_WARPS
python3 tools/diff_step_kernels.py --top 14 /tmp/pd_off/d1.json /tmp/pd_on/d1.json > $OUT/3_diffs.txt 2>&1
python3 tools/diff_step_kernels.py --top 8 /tmp/pd_on/d1.json /tmp/pd_w16/d1.json >> $OUT/3_diffs.txt 2>&1
cat $OUT/3_diffs.txt; grep -h "decode:.*launches" $OUT/3_probe_*.log
