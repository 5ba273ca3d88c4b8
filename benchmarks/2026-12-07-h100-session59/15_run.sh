# Prepared in session 58 (2026-12-07): the next session's first call, one plan per card (sessions 56-58
# asked for `nvidia-h200` and got no H200 run: refusals, a machine taken back mid-run, H100s lent instead).
# An H200 runs 1a_run.sh (issue 6's MD3 / MD2 W1 on the card its targets name; then 1b_run.sh as the next
# call on the same machine, carrying [".peerx"]); an H100 runs 14_run.sh (KESTREL_JAX_DENSE_OUT_MERGED's
# check, probe and W1 pairs). Move the scripts it names into the session's dated folder first and edit
# the paths below to match.
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $G"
case "$G" in
  *H200*) bash benchmarks/2026-12-07-h100-session59/1a_run.sh ;;
  *) bash benchmarks/2026-12-07-h100-session59/14_run.sh ;;
esac
