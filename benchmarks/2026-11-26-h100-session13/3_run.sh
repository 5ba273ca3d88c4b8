# Session 13, call 3: one-crop images encoded together (new image step), G = 1..8 images per step,
# MD3 vision encoder at full size, random weights, bf16, cuDNN attention.
export PYTHONPATH=$PWD
python3 tools/bench_vision_batch.py --model md3 --images 1 2 3 4 6 8 --out $OUT/3_vision_batch.json 2>&1 \
  | grep -v "cuda_event.cc\|cuda_stream.cc\|^$" | tee $OUT/3_vision_batch.log | tail -12
