# Prepared in session 59 (2026-12-07): the next session's first call, one plan per card (sessions 56-59
# asked for `nvidia-h200` and were lent H100s). An H200 runs 1a_run.sh (issue 6's MD3 / MD2 W1 on the card
# its targets name; then 1b_run.sh as the next call on the same machine, carrying [".peerx"]); an H100
# runs 19_run.sh (the text decode step on MD2, and the probes). Move the scripts it names into the
# session's dated folder first and edit the paths below to match.
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $G"
case "$G" in
  *H200*) bash benchmarks/2026-12-07-h100-session60/1a_run.sh ;;
  *) bash benchmarks/2026-12-07-h100-session60/19_run.sh ;;
esac
