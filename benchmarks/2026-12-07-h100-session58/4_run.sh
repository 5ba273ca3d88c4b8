# Prepared in session 56 (2026-12-07) for any H100 / H200 (~8 device minutes; move it into the session's
# dated folder first). Session 56 set the one-row LayerNorm rows kernels' ring to 6 slots
# (gemv_mgpu.ROWS_STAGES_LN) from MD2 W1 runs of 4, 5, 6 and 8 slots, where 5 slots had one run at 799.4
# tok/s against 792.4 / 790.9 for 6. (1) the rows kernel alone at the new defaults, late bias and 5 / 8
# slots (tools/bench_rows_kernel.py); (2) MD2 W1, 6 against 5 slots, alternating, two pairs, each run its
# own process and compile cache; (3) MD3 W1, 6 against 5 slots, one pair. Set ROWS_STAGES_LN to 5 if
# both models' pairs favour it. (Session 57: KESTREL_JAX_GEMV_ROWS_STAGES, set alone, now also sets the MoE
# QKV + router kernel's ring, whose own default became 8, ROWS_STAGES_MOE_LN; for MD3's pair add
# KESTREL_JAX_GEMV_ROWS_STAGES_MOE=8 to vary the dense layers' ring alone.)
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/4_env.txt
timeout 150 python3 tools/bench_rows_kernel.py --layers 16 --rounds 2 --budget-s 110 \
  --cases md2,md2_late,md2_st5,md2_st8,md3,md3_st6 --out $OUT/4_rows.json 2>&1 | grep -v "$FILT" > $OUT/4_rows.log
grep "^{" $OUT/4_rows.log | cut -c1-200
A="--random-weights --workloads w1 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for c in "md2 6" "md2 5" "md2 5" "md2 6" "md3 6" "md3 5"; do
  set -- $c; [ $SECONDS -gt 520 ] && break
  KESTREL_JAX_GEMV_ROWS_STAGES_MOE=8 KESTREL_JAX_GEMV_ROWS_STAGES=$2 timeout $((580 - SECONDS)) python3 tools/benchmark.py --model $1 $A \
    --compile-cache /tmp/cc_$1_$2 --out $OUT/4_w1_$1_st$2_$SECONDS.json > /tmp/w1.log 2>&1
  echo "$1 slots $2 ($SECONDS s): $(grep -o 'w1: .*of copy)' /tmp/w1.log)" | tee -a $OUT/4_w1.txt
done
