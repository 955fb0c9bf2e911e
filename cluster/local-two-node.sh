#!/usr/bin/env bash
# A real two-node Ray cluster on one machine, for tests and for trying multi-node locally.
#
#   cluster/local-two-node.sh up            # prints the state dir; `source <dir>/env` to use it
#   cluster/local-two-node.sh down <dir>    # stops exactly the processes `up` started
#   cluster/local-two-node.sh status <dir>  # nodes the head sees
#   cluster/local-two-node.sh kill-node <dir>  # SIGKILL every process of the second node
#   cluster/local-two-node.sh revive-node <dir>  # start the second node again after kill-node
#   cluster/local-two-node.sh head          # one node only: a local head for `ray job submit`
#
# Every port is picked free (GCS, dashboard, node/object managers, agents, metrics, worker
# port ranges), so this never clashes with another Ray on the machine. The dashboard (and
# with it the jobs API) listens on 127.0.0.1 only. Ray 2.60
# replaces a loopback --node-ip-address with the machine's routable address and its gRPC
# servers listen on all interfaces, so token authentication is on, with a token private to
# this cluster (never ~/.ray/auth_token): nothing answers without it.
# `down` kills only the two process groups recorded by `up` -- never `ray stop`, which
# would stop every Ray instance on the machine by name.
# The two nodes share no directory, as two machines would not: each runs in its own working
# directory (<state>/head, <state>/node) with its own Ray temp dir (<state>/ray, <state>/ray-node),
# so a run whose storage is not shared (run.storage_path=s3://...) is tested as on a real cluster.
#
# `head` is `up` without the second node (cluster/local-head.sh wraps it: start | stop), with
# RT2N_HEAD_CPUS defaulting to the machine's cores plus 2 (at least 4: two workers and Ray
# Data's tasks), as raytrain-ddp sizes its embedded instance.
# Knobs (environment): RT2N_HEAD_CPUS / RT2N_NODE_CPUS (default 3 each),
# RT2N_OBJECT_STORE_BYTES (default 200 MB per node), RT2N_UP_TIMEOUT_S (default 90),
# RT2N_START_TRIES (default 3), PYTHON (default: python next to `ray` on PATH), RAY (default:
# `ray` on PATH).
#
# A node's `ray start` gives up when its raylet has not registered within Ray's own 30 s (not
# configurable; seen on a busy 2-core machine): such a start is tried again, RT2N_START_TRIES
# times in all, as the embedded start of `raytrain-ddp train` does. So is a start that failed on
# a picked port another program took before Ray bound it (seen with three test processes
# starting Ray at once), with every port picked afresh.
set -euo pipefail

RAY_BIN="${RAY:-$(command -v ray || true)}"
if [[ -z "$RAY_BIN" ]]; then
  echo "local-two-node: 'ray' is not on PATH; activate the project venv (source .venv/bin/activate) or set RAY=/path/to/ray" >&2
  exit 2
fi
PY_BIN="${PYTHON:-$(dirname "$RAY_BIN")/python}"
[[ -x "$PY_BIN" ]] || PY_BIN="$(command -v python3)"

HEAD_CPUS="${RT2N_HEAD_CPUS:-3}"
NODE_CPUS="${RT2N_NODE_CPUS:-3}"
STORE_BYTES="${RT2N_OBJECT_STORE_BYTES:-200000000}"
UP_TIMEOUT_S="${RT2N_UP_TIMEOUT_S:-90}"
START_TRIES="${RT2N_START_TRIES:-3}"
STARTUP_TIMED_OUT="timed out during startup"  # what `ray start` says when Ray's 30 s wait ran out
# The nodes' worker processes run at the nodes' own niceness, not Ray's default 15: these nodes
# share one machine with everything else on it, where at 15 any busy process of normal priority
# takes the workers' cores (as on the embedded instance: docs/design.md#the-embedded-instance-starts-lean).
# Exported for every command, so a revived node (revive-node) gets it too; overridable.
export RAY_worker_niceness="${RAY_worker_niceness:-0}"

usage() {
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# Print N distinct free TCP ports on 127.0.0.1 followed by two free ranges of 100 ports
# (one worker-port range per node). Sockets stay bound until all are chosen, so the N
# ports are distinct; a small race with other programs remains, as with any free-port pick.
free_ports() {
  "$PY_BIN" - "$1" <<'EOF'
import random, socket, sys
n = int(sys.argv[1])
held, ports = [], []
for _ in range(n):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); held.append(s); ports.append(s.getsockname()[1])
def range_free(lo, hi):
    for p in range(lo, hi + 1):
        if p in ports:
            return False
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            return False
        finally:
            s.close()
    return True
ranges = []
rng = random.Random()
while len(ranges) < 2:
    lo = rng.randrange(20000, 32000 - 100)
    if all(abs(lo - r) > 100 for r in ranges) and range_free(lo, lo + 99):
        ranges.append(lo)
for s in held:
    s.close()
print(" ".join(map(str, ports + ranges)))
EOF
}

# Set NODE_ARGS to the `ray start` flags both nodes share: loopback, the node's own pinned
# ports and worker-port range, CPUs, the object store, and a custom resource naming the
# node (so tests can place work on it). Arguments: RESOURCE CPUS NM OM AG AGG RE MET WLO.
node_args() {
  local resource="$1" cpus="$2" nm="$3" om="$4" ag="$5" agg="$6" re="$7" met="$8" wlo="$9"
  NODE_ARGS=(--node-ip-address=127.0.0.1
    --node-manager-port="$nm" --object-manager-port="$om"
    --dashboard-agent-listen-port="$ag" --dashboard-agent-grpc-port="$agg"
    --runtime-env-agent-port="$re" --metrics-export-port="$met"
    --min-worker-port="$wlo" --max-worker-port="$((wlo + 99))"
    --num-cpus="$cpus" --num-gpus=0 --object-store-memory="$STORE_BYTES"
    --resources="{\"$resource\": 1}" --disable-usage-stats)
}

# Start "$@" in its own session (so it has its own process group), in working directory
# $2, and print its pid.
start_group() {
  local log="$1" cwd="$2"; shift 2
  mkdir -p "$cwd"
  (cd "$cwd" && exec setsid "$@" >"$log" 2>&1 < /dev/null) &
  echo $!
}

# Wait until the head's GCS accepts connections; fail fast if the head process died.
wait_for_gcs() {
  local dir="$1" port="$2" pgid="$3" deadline=$((SECONDS + UP_TIMEOUT_S))
  while (( SECONDS < deadline )); do
    group_alive "$pgid" || { echo "local-two-node: the head exited during start-up" >&2; return 1; }
    if "$PY_BIN" -c "import socket,sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1).close()" "$port" 2>/dev/null; then
      return 0
    fi
    sleep 0.3
  done
  echo "local-two-node: the head's GCS did not listen on 127.0.0.1:$port within ${UP_TIMEOUT_S}s" >&2
  return 1
}

# Wait until the head sees $2 nodes alive. Exits 3 at once if a node's log ($dir/head.log,
# $dir/node.log) says its start-up timed out (see start_timed_out). A probe whose own Ray
# driver died connecting is run again until the timeout: on a loaded machine one met a
# raylet still registering ("Failed to get the system config from raylet because it is dead").
wait_for_nodes() {
  local dir="$1" want="$2" deadline=$((SECONDS + UP_TIMEOUT_S)) rc
  while :; do
    rc=0; probe_nodes "$dir" "$want" "$((deadline - SECONDS))" || rc=$?
    if (( rc == 0 || rc == 3 || SECONDS >= deadline )); then return "$rc"; fi
    echo "local-two-node: the node probe ended with status $rc; probing again" >&2
    sleep 1
  done
}

# One probe of wait_for_nodes, for at most $3 seconds.
probe_nodes() {
  local dir="$1" want="$2" seconds="$3"
  # shellcheck disable=SC1091
  ( source "$dir/env"
    RT2N_WANT="$want" RT2N_TIMEOUT="$seconds" RT2N_LOGS="$dir/head.log $dir/node.log" \
    RT2N_TIMED_OUT="$STARTUP_TIMED_OUT" timeout "$((seconds + 10))" "$PY_BIN" - <<'EOF'
import os, sys, time
def timed_out():
    for path in os.environ["RT2N_LOGS"].split():
        if os.path.exists(path) and os.environ["RT2N_TIMED_OUT"] in open(path, errors="replace").read():
            print(f"local-two-node: {path}: the node's start-up timed out", file=sys.stderr)
            sys.exit(3)
timed_out()
import ray
want, deadline = int(os.environ["RT2N_WANT"]), time.time() + float(os.environ["RT2N_TIMEOUT"])
try:
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
except Exception:
    timed_out()
    raise
while True:
    timed_out()
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want:
        print(f"local-two-node: {len(alive)} node{'s' * (len(alive) != 1)} alive")
        sys.exit(0)
    if time.time() > deadline:
        print(f"local-two-node: only {len(alive)} of {want} nodes alive after the timeout", file=sys.stderr)
        sys.exit(1)
    time.sleep(0.5)
EOF
  )
}

# Each node runs in its own session (setsid): its `ray start`, raylet, agents and every worker
# process (Ray puts each worker in a process group of its own, but not in a new session).
# The session id is the pid recorded in <name>.pgid.

# Members of session $1 that are still running (zombies count as gone: they have
# exited and only wait for their parent, which may be init, to reap them).
group_alive() {
  ps -eo sid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {n++} END {exit n ? 0 : 1}'
}

# Send signal $1 to every process of session $2 (only that session: never anything by name).
signal_session() {
  local pid
  for pid in $(ps -eo sid=,pid= | awk -v g="$2" '$1 == g {print $2}'); do
    kill "-$1" "$pid" 2>/dev/null || true
  done
}

# Whether no process (zombies aside) of any given session is left.
sessions_gone() {
  local sid
  for sid in "$@"; do group_alive "$sid" && return 1; done
  return 0
}

# SIGTERM every given session at once, wait up to 10 s for all of them, then SIGKILL whatever
# is left and wait (10 s at most) until none of their processes is: a SIGKILLed process still
# takes a moment to exit (seen: a head's gcs_server, under load, after `down` had returned),
# and each SIGKILL round also reaches what was forked meanwhile.
kill_groups() {
  local sid
  for sid in "$@"; do signal_session TERM "$sid"; done
  for _ in $(seq 1 50); do
    sessions_gone "$@" && return 0
    sleep 0.2
  done
  for _ in $(seq 1 50); do
    for sid in "$@"; do signal_session KILL "$sid"; done
    sessions_gone "$@" && return 0
    sleep 0.2
  done
  echo "local-two-node: processes of session(s) $* still exist 10 s after SIGKILL" >&2
}

# `kill-node <dir>`: SIGKILL every process of the second node at once, as a lost machine
# (tests of node loss; the head, and with it the cluster, stays up).
cmd_kill_node() {
  local dir="${1:-}"
  [[ -f "$dir/rt2n" && -f "$dir/node.pgid" ]] || { echo "local-two-node: kill-node needs the state dir printed by 'up'" >&2; exit 2; }
  signal_session KILL "$(cat "$dir/node.pgid")"
}

# Start the second node from the command `up` recorded, in a session of its own.
start_node() {
  local dir="$1" node_pid
  local -a cmd
  eval "cmd=($(cat "$dir/node.cmd"))"
  node_pid=$(start_group "$dir/node.log" "$dir/node" "${cmd[@]}")
  echo "$node_pid" > "$dir/node.pgid"
}

# Whether the log of node $2 (head or node) in $1 says its `ray start` timed out.
start_timed_out() {
  grep -q "$STARTUP_TIMED_OUT" "$1/$2.log" 2>/dev/null
}

# Stop what a timed-out start of node $2 (head or node) left, keeping its log as <name>.log.<n>.
discard_start() {
  local dir="$1" name="$2" n=1
  kill_groups "$(cat "$dir/$name.pgid")"
  while [[ -e "$dir/$name.log.$n" ]]; do n=$((n + 1)); done
  mv "$dir/$name.log" "$dir/$name.log.$n"
}

# Start the second node and wait for $2 nodes, once more (START_TRIES in all) while its
# start timed out. Fails (1) on any other failure, or with the head's start timed out (4).
start_node_and_wait() {
  local dir="$1" want="$2" try rc
  for ((try = 1; try <= START_TRIES; try++)); do
    start_node "$dir"
    rc=0; wait_for_nodes "$dir" "$want" >&2 || rc=$?
    (( rc == 0 )) && return 0
    start_timed_out "$dir" head && return 4
    if ! start_timed_out "$dir" node || (( try == START_TRIES )); then return 1; fi
    echo "local-two-node: the second node did not start within Ray's 30 s (is the machine busy?); try $((try + 1)) of $START_TRIES" >&2
    discard_start "$dir" node
  done
  return 1
}

# `revive-node <dir>`: the second node again, after `kill-node` (a new node to Ray, same
# resources and ports), once every process of the killed one is gone; waits for 2 nodes.
cmd_revive_node() {
  local dir="${1:-}"
  [[ -f "$dir/rt2n" && -f "$dir/node.cmd" ]] || { echo "local-two-node: revive-node needs the state dir printed by 'up'" >&2; exit 2; }
  if group_alive "$(cat "$dir/node.pgid")"; then
    echo "local-two-node: the second node is still running; revive-node is for after kill-node" >&2; exit 2
  fi
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$dir/auth_token" RAY_USAGE_STATS_ENABLED=0
  export RAY_health_check_period_ms="${RAY_health_check_period_ms:-1000}"
  export RAY_health_check_timeout_ms="${RAY_health_check_timeout_ms:-1000}"
  export RAY_health_check_failure_threshold="${RAY_health_check_failure_threshold:-3}"
  if ! start_node_and_wait "$dir" 2; then
    tail -n 30 "$dir/node.log" >&2; exit 1
  fi
}

cmd_down() {
  local dir="${1:-}"
  [[ -n "$dir" && -d "$dir" ]] || { echo "local-two-node: down needs the state dir printed by 'up'" >&2; exit 2; }
  [[ -f "$dir/rt2n" ]] || { echo "local-two-node: $dir was not created by 'up' (no rt2n marker); refusing to touch it" >&2; exit 2; }
  local groups=()
  for name in node head; do
    [[ -f "$dir/$name.pgid" ]] && groups+=("$(cat "$dir/$name.pgid")")
  done
  (( ${#groups[@]} )) && kill_groups "${groups[@]}"
  if [[ "${RT2N_KEEP:-0}" == "1" ]]; then
    echo "local-two-node: stopped; logs kept in $dir"
  else
    rm -rf "$dir"
    echo "local-two-node: stopped and removed $dir"
  fi
}

# Pick every port afresh and write the state dir's env file and the two nodes' commands
# (head.cmd, node.cmd), and set GCS and DASH (the head's ports): before each start of the
# cluster, so a port another program took between the pick and Ray's bind is not asked for again.
write_start_commands() {
  local dir="$1" CLIENT H_NM H_OM H_AG H_AGG H_RE H_MET N_NM N_OM N_AG N_AGG N_RE N_MET H_WLO N_WLO
  read -r GCS DASH CLIENT \
          H_NM H_OM H_AG H_AGG H_RE H_MET \
          N_NM N_OM N_AG N_AGG N_RE N_MET \
          H_WLO N_WLO <<<"$(free_ports 15)"

  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$dir/auth_token" RAY_USAGE_STATS_ENABLED=0
  # How fast the GCS declares a lost node dead: the same settings as the cluster files
  # (docs/reliability.md#node-loss); each may be overridden from the environment.
  export RAY_health_check_period_ms="${RAY_health_check_period_ms:-1000}"
  export RAY_health_check_timeout_ms="${RAY_health_check_timeout_ms:-1000}"
  export RAY_health_check_failure_threshold="${RAY_health_check_failure_threshold:-3}"
  cat > "$dir/env" <<EOF
# source this file to talk to the ${WHAT:-local two-node cluster}
export RAY_ADDRESS=127.0.0.1:$GCS
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$dir/auth_token
export RT2N_DIR=$dir
export RT2N_DASHBOARD=http://127.0.0.1:$DASH
EOF

  node_args node_a "$HEAD_CPUS" "$H_NM" "$H_OM" "$H_AG" "$H_AGG" "$H_RE" "$H_MET" "$H_WLO"
  printf '%q ' "$RAY_BIN" start --head --block \
    --port="$GCS" --temp-dir="$dir/ray" \
    --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$DASH" \
    --ray-client-server-port="$CLIENT" "${NODE_ARGS[@]}" > "$dir/head.cmd"
  node_args node_b "$NODE_CPUS" "$N_NM" "$N_OM" "$N_AG" "$N_AGG" "$N_RE" "$N_MET" "$N_WLO"
  # The second node's command, kept for `revive-node` (its ports are free again once it is killed).
  printf '%q ' "$RAY_BIN" start --block --address="127.0.0.1:$GCS" --temp-dir="$dir/ray-node" "${NODE_ARGS[@]}" \
    > "$dir/node.cmd"
}

# Whether a node's `ray start` (head or node) failed on a port another program had taken.
port_taken() {
  grep -qiE "address already in use|already occupied" "$1/head.log" "$1/node.log" 2>/dev/null
}

cmd_up() {
  local nodes="${1:-2}" dir
  WHAT="local two-node cluster"; (( nodes == 1 )) && WHAT="local one-node head"  # the env file names it
  # Short path: Ray puts unix sockets under the temp dir, and those are limited to ~107 bytes.
  dir="$(mktemp -d /tmp/rt2n-XXXX)"
  touch "$dir/rt2n"
  # Said first, so a caller that gives up on `up` (a timeout) can still `down` what it started.
  echo "local-two-node: state dir $dir" >&2
  # A token for this cluster only; file mode 600 because it grants full control of the cluster.
  (umask 077; "$PY_BIN" -c 'import secrets; print(secrets.token_hex(32), end="")' > "$dir/auth_token")

  local try rc
  for ((try = 1; try <= START_TRIES; try++)); do
    write_start_commands "$dir"
    rc=0; start_cluster "$dir" "$nodes" || rc=$?
    (( rc == 0 )) && break
    if (( try == START_TRIES )) || ! { (( rc == 4 )) || port_taken "$dir"; }; then
      tail -n 30 "$dir/head.log" "$dir/node.log" >&2; RT2N_KEEP=1 cmd_down "$dir" >&2; exit 1
    fi
    if (( rc == 4 )); then
      echo "local-two-node: the head did not start within Ray's 30 s (is the machine busy?); try $((try + 1)) of $START_TRIES" >&2
    else
      echo "local-two-node: a port picked for Ray was taken by another program before Ray bound it; new ports, try $((try + 1)) of $START_TRIES" >&2
    fi
    [[ -f "$dir/node.pgid" ]] && discard_start "$dir" node
    discard_start "$dir" head
  done
  if (( nodes == 1 )); then
    echo "local-two-node: head up. Use it with:  source $dir/env  (ray job submit --address \$RT2N_DASHBOARD ...)" >&2
  else
    echo "local-two-node: up. Use it with:  source $dir/env" >&2
  fi
  # local-head.sh sets RT2N_STOP_CMD: the hint names the command its user ran (docs/cluster.md)
  echo "local-two-node: stop it with:     ${RT2N_STOP_CMD:-$0 down} $dir" >&2
  echo "$dir"
}

# Start the head from head.cmd, then (nodes 2) the second node (start_node_and_wait); 4: the
# head's own start timed out (cmd_up starts both again), 1: any other failure.
start_cluster() {
  local dir="$1" nodes="${2:-2}" gcs="$GCS" dash="$DASH" head_pid
  local -a cmd
  eval "cmd=($(cat "$dir/head.cmd"))"
  head_pid=$(start_group "$dir/head.log" "$dir/head" "${cmd[@]}")
  echo "$head_pid" > "$dir/head.pgid"
  echo "local-two-node: head pid $head_pid, GCS 127.0.0.1:$gcs, dashboard 127.0.0.1:$dash" >&2
  if ! wait_for_gcs "$dir" "$gcs" "$head_pid"; then
    start_timed_out "$dir" head && return 4
    return 1
  fi
  if (( nodes == 1 )); then
    wait_for_nodes "$dir" 1 >&2
    return
  fi
  start_node_and_wait "$dir" 2
}

cmd_status() {
  local dir="${1:-}"
  [[ -f "$dir/env" ]] || { echo "local-two-node: status needs the state dir printed by 'up'" >&2; exit 2; }
  # shellcheck disable=SC1091
  ( source "$dir/env"; "$RAY_BIN" status --address "$RAY_ADDRESS" )
}

# Sourced (tests/local/unit/test_cluster_script.py): the functions only.
[[ "${BASH_SOURCE[0]}" != "$0" ]] && return 0

case "${1:-}" in
  up) cmd_up 2 ;;
  head) HEAD_CPUS="${RT2N_HEAD_CPUS:-$(( $(nproc) + 2 > 4 ? $(nproc) + 2 : 4 ))}"; cmd_up 1 ;;
  down) cmd_down "${2:-${RT2N_DIR:-}}" ;;
  status) cmd_status "${2:-${RT2N_DIR:-}}" ;;
  kill-node) cmd_kill_node "${2:-${RT2N_DIR:-}}" ;;
  revive-node) cmd_revive_node "${2:-${RT2N_DIR:-}}" ;;
  *) usage ;;
esac
