#!/usr/bin/env bash
# A local Ray head on this machine, for `ray job submit` (docs/cluster.md#a-local-head).
#
#   cluster/local-head.sh start        # prints the state dir; `source <dir>/env` to use it
#   cluster/local-head.sh stop <dir>   # stops exactly the processes `start` started
#
# Token authentication on (a token private to this head, never ~/.ray/auth_token), every
# port picked free (GCS, dashboard, agents, ...), the dashboard and jobs API on 127.0.0.1,
# Ray's temp dir inside the state dir (no /tmp/ray/ray_current_cluster is written). `stop`
# ends the head's whole session (`ray start --head --block`, GCS, raylet, dashboard, agents
# and every worker process: all of them, recorded by session id), never `ray stop`, which
# stops every Ray on the machine. The machinery is cluster/local-two-node.sh's, one node.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
case "${1:-}" in
  start) RT2N_STOP_CMD="$0 stop" exec "$here/local-two-node.sh" head ;;
  stop) exec "$here/local-two-node.sh" down "${2:-${RT2N_DIR:-}}" ;;
  *) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
