# Session 58: one call, two plans by the card that came. An H200 runs 1a_run.sh (issue 6's batch-1
# figures on the card its targets name; 1b follows on the same machine if it stays warm); an H100 runs
# 4_run.sh (5 against 6 ring slots for the dense one-row LayerNorm rows kernels; the MoE kernel's ring
# held at its default 8 throughout).
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $G"
case "$G" in
  *H200*) bash benchmarks/2026-12-07-h100-session58/1a_run.sh ;;
  *) bash benchmarks/2026-12-07-h100-session58/4_run.sh ;;
esac
