#!/usr/bin/env bash
# A Warren cluster on one machine: N `warren serve` processes, each in its own network
# namespace behind a veth pair on a bridge in the root namespace, so every node has an address
# (and the standard ports) of its own, nodes can be killed, restarted and partitioned, and the
# host still reaches every node (tests talk to both sides of a partition).
#
#   scripts/cluster.sh up N          start (or complete) an N-node cluster; prints per node
#                                    `NODE amqp=HOST:PORT mqtt=HOST:PORT http=HOST:PORT`
#                                    once that node accepts clients
#   scripts/cluster.sh status        the same lines for the running nodes
#   scripts/cluster.sh kill NODE     SIGKILL one node (NODE: n2 or 2)
#   scripts/cluster.sh start NODE    start a stopped node again (same data dir); prints its line
#   scripts/cluster.sh pause NODE    SIGSTOP it (a node that hangs: sockets open, no answers)
#   scripts/cluster.sh resume NODE   SIGCONT it
#   scripts/cluster.sh partition NODE...  cut these nodes off from the others (blackhole routes
#                                    on both sides; the host still reaches everyone)
#   scripts/cluster.sh heal          remove every partition
#   scripts/cluster.sh down          stop every node, remove namespaces, veths, bridge, state
#
# Needs root and `ip netns` (iproute2). Every command is idempotent and every wait bounded.
# Environment:
#   WARREN_BIN            the broker binary (default: target/debug/warren of this checkout)
#   WARREN_CLUSTER_DIR    state: node data dirs, logs, pids (default /tmp/warren-cluster)
#   WARREN_CLUSTER_NET    first three octets of the /24 used (default 10.77.0; host is .1,
#                         node i is .(10+i))
#   WARREN_CLUSTER_BRIDGE the bridge's name, also the prefix of namespaces/veths (default wbr0)
#   WARREN_CLUSTER_WAIT   seconds to wait for a node to accept clients (default 30)
#   WARREN_CLUSTER_TLS_DIR  if set: TLS on the cluster port, node i with
#                         --cluster-tls-cert DIR/ni.pem --cluster-tls-key DIR/ni.key
#                         --cluster-tls-ca DIR/ca.pem (its certificate names its IP)
#   WARREN_CLUSTER_SHARDS   if set: every node runs `warren serve --shards N`
#   WARREN_CLUSTER_USER, WARREN_CLUSTER_PASSWORD  an administrator created on every node
#                         (default warren/warren): `guest` may log in from loopback only, and
#                         the host is not loopback to a node
# When the binary has cluster flags (`warren serve --help` lists --node-id), nodes are started
# as members of one cluster: --node-id i, --cluster ADDR:25672, --peers of the others, and a
# shared secret generated once in the state dir.
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
WARREN=${WARREN_BIN:-$repo/target/debug/warren}
STATE=${WARREN_CLUSTER_DIR:-/tmp/warren-cluster}
NET=${WARREN_CLUSTER_NET:-10.77.0}
BR=${WARREN_CLUSTER_BRIDGE:-wbr0}
WAIT=${WARREN_CLUSTER_WAIT:-30}
HOST_IP=$NET.1
AMQP_PORT=5672
MQTT_PORT=1883
HTTP_PORT=15672
PROM_PORT=15692
CLUSTER_PORT=25672
MAX_NODES=50
USER_NAME=${WARREN_CLUSTER_USER:-warren}
USER_PASS=${WARREN_CLUSTER_PASSWORD:-warren}

die() { echo "cluster.sh: $*" >&2; exit 1; }

need_netns() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
  command -v ip >/dev/null || die "needs iproute2 (ip)"
  ip netns list >/dev/null 2>&1 || die "ip netns unavailable on this machine"
}

ns() { echo "$BR-n$1"; }           # namespace of node i
veth() { echo "${BR}v$1"; }        # host side of node i's veth pair (<= 15 chars)
ip_of() { echo "$NET.$((10 + $1))"; }
dir_of() { echo "$STATE/n$1"; }

size() { cat "$STATE/size" 2>/dev/null || echo 0; }

node_index() { # n2 | 2 -> 2
  local n=${1#n}
  [[ "$n" =~ ^[0-9]+$ ]] || die "bad node name '$1' (n1, n2, ... or 1, 2, ...)"
  [ "$n" -ge 1 ] && [ "$n" -le "$(size)" ] || die "no node $1 (cluster has $(size) nodes)"
  echo "$n"
}

pid_of() { # prints the pid if node i's broker is running
  local f; f="$(dir_of "$1")/pid"
  [ -f "$f" ] || return 1
  local pid; pid=$(cat "$f")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  # The pid file could be stale and the pid reused: check it is our binary.
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "--data-dir $(dir_of "$1")/data" ||
    return 1
  echo "$pid"
}

ensure_bridge() {
  if ! ip link show "$BR" >/dev/null 2>&1; then
    ip link add "$BR" type bridge || die "cannot create bridge $BR"
  fi
  ip addr replace "$HOST_IP/24" dev "$BR"
  ip link set "$BR" up
}

ensure_netns() { # i
  local i=$1 n; n=$(ns "$i")
  if ! ip netns list | awk '{print $1}' | grep -qx "$n"; then
    ip netns add "$n" || die "cannot create namespace $n"
  fi
  if ! ip link show "$(veth "$i")" >/dev/null 2>&1; then
    # A leftover peer inside the namespace would block the name: remove it first.
    ip -n "$n" link del eth0 2>/dev/null
    ip link add "$(veth "$i")" type veth peer name eth0 netns "$n" ||
      die "cannot create veth for node $i"
  fi
  ip link set "$(veth "$i")" master "$BR"
  ip link set "$(veth "$i")" up
  ip -n "$n" link set lo up
  ip -n "$n" addr replace "$(ip_of "$i")/24" dev eth0
  ip -n "$n" link set eth0 up
}

cluster_flags() { # i: prints the cluster flags of node i, one per line, if the binary has them
  "$WARREN" serve --help 2>/dev/null | grep -q -- '--node-id' || return 0
  local i=$1 j peers=""
  for ((j = 1; j <= $(size); j++)); do
    [ "$j" = "$i" ] && continue
    peers+="${peers:+,}$j=$(ip_of "$j"):$CLUSTER_PORT"
  done
  printf '%s\n' --node-id "$i" --cluster "$(ip_of "$i"):$CLUSTER_PORT" \
    --cluster-secret-file "$STATE/secret"
  if [ -n "${WARREN_CLUSTER_TLS_DIR:-}" ]; then
    printf '%s\n' --cluster-tls-cert "$WARREN_CLUSTER_TLS_DIR/n$i.pem" \
      --cluster-tls-key "$WARREN_CLUSTER_TLS_DIR/n$i.key" --cluster-tls-ca "$WARREN_CLUSTER_TLS_DIR/ca.pem"
  fi
  [ -n "$peers" ] && printf '%s\n' --peers "$peers"
}

probe() { # host port: true once a TCP connection succeeds
  timeout 1 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null
}

line_of() { # i
  local a; a=$(ip_of "$1")
  echo "n$1 amqp=$a:$AMQP_PORT mqtt=$a:$MQTT_PORT http=$a:$HTTP_PORT"
}

wait_ready() { # i: until the node accepts AMQP, MQTT and HTTP clients, or WAIT seconds
  local i=$1 a deadline=$((SECONDS + WAIT)) p
  a=$(ip_of "$i")
  for p in $AMQP_PORT $MQTT_PORT $HTTP_PORT; do
    until probe "$a" "$p"; do
      pid_of "$i" >/dev/null || die "node n$i exited; log: $(dir_of "$i")/log"
      [ $SECONDS -lt $deadline ] || die "node n$i not accepting on $a:$p after ${WAIT}s; log: $(dir_of "$i")/log"
      sleep 0.1
    done
  done
  ensure_user "$i"
}

ensure_user() { # i: the administrator exists on node i (once per data dir)
  local d; d=$(dir_of "$1")
  [ -f "$d/user-added" ] && return 0
  local ctl=("$WARREN" ctl --data-dir "$d/data")
  # In a cluster the user is replicated: on the second node it exists already.
  { "${ctl[@]}" add-user "$USER_NAME" "$USER_PASS" >>"$d/log" 2>&1 ||
    "${ctl[@]}" list-users 2>>"$d/log" | grep -qw -- "$USER_NAME"; } &&
    "${ctl[@]}" set-user-tags "$USER_NAME" administrator >>"$d/log" 2>&1 &&
    "${ctl[@]}" set-permissions "$USER_NAME" '.*' '.*' '.*' >>"$d/log" 2>&1 ||
    die "cannot create user $USER_NAME on n$1; log: $d/log"
  touch "$d/user-added"
}

start_node() { # i: start node i unless running; no output
  local i=$1 d; d=$(dir_of "$i")
  pid_of "$i" >/dev/null && return 0
  [ -x "$WARREN" ] || die "broker binary $WARREN not found: cargo build -p warren-cli, or set WARREN_BIN"
  mkdir -p "$d/data"
  local a; a=$(ip_of "$i")
  local flags; mapfile -t flags < <(cluster_flags "$i")
  [ -n "${WARREN_CLUSTER_SHARDS:-}" ] && flags+=(--shards "$WARREN_CLUSTER_SHARDS")
  # The shell inside the namespace writes its own pid, then execs the broker: the pid file
  # is the broker's pid (ip netns exec and sh both exec, no fork).
  ip netns exec "$(ns "$i")" sh -c 'echo $$ >"$1"; shift; exec "$@"' sh "$d/pid" \
    "$WARREN" serve --amqp "$a:$AMQP_PORT" --mqtt "$a:$MQTT_PORT" \
    --management "$a:$HTTP_PORT" --prometheus "$a:$PROM_PORT" \
    --data-dir "$d/data" "${flags[@]}" >>"$d/log" 2>&1 </dev/null &
  disown 2>/dev/null
  local deadline=$((SECONDS + 5))
  until pid_of "$i" >/dev/null; do
    [ $SECONDS -lt $deadline ] || die "node n$i did not start; log: $d/log"
    sleep 0.05
  done
}

kill_node() { # i sig
  local pid deadline=$((SECONDS + WAIT))
  pid=$(pid_of "$1") || return 0
  kill "-$2" "$pid" 2>/dev/null
  # A paused node (SIGSTOP) handles SIGTERM only once it runs again.
  kill -CONT "$pid" 2>/dev/null
  while kill -0 "$pid" 2>/dev/null; do
    if [ $SECONDS -ge $deadline ]; then
      kill -KILL "$pid" 2>/dev/null
      deadline=$((SECONDS + 5))
    fi
    sleep 0.05
  done
  rm -f "$(dir_of "$1")/pid"
}

cmd_up() {
  local n=${1:-}
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le $MAX_NODES ] ||
    die "usage: cluster.sh up N (1..$MAX_NODES)"
  need_netns
  local old; old=$(size)
  if [ "$old" -ne 0 ] && [ "$old" -ne "$n" ]; then
    # The members' --peers lists are fixed at first start: another size is another cluster.
    die "a $old-node cluster is up; run 'cluster.sh down' first"
  fi
  mkdir -p "$STATE"
  echo "$n" >"$STATE/size"
  if [ ! -s "$STATE/secret" ]; then
    (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE/secret")
  fi
  ensure_bridge
  local i
  for ((i = 1; i <= n; i++)); do ensure_netns "$i"; done
  for ((i = 1; i <= n; i++)); do start_node "$i"; done
  for ((i = 1; i <= n; i++)); do wait_ready "$i" && line_of "$i"; done
}

cmd_status() {
  local i
  for ((i = 1; i <= $(size); i++)); do
    if pid_of "$i" >/dev/null; then line_of "$i"; else echo "n$i stopped"; fi
  done
}

cmd_kill() {
  [ $# -ge 1 ] || die "usage: cluster.sh kill NODE"
  local i; i=$(node_index "$1") || exit 1
  kill_node "$i" KILL
}

cmd_start() {
  [ $# -ge 1 ] || die "usage: cluster.sh start NODE"
  need_netns
  local i; i=$(node_index "$1") || exit 1
  ensure_bridge
  ensure_netns "$i"
  start_node "$i"
  wait_ready "$i" && line_of "$i"
}

cmd_signal() { # SIG NODE
  [ $# -ge 2 ] || die "usage: cluster.sh pause|resume NODE"
  local i pid; i=$(node_index "$2") || exit 1
  pid=$(pid_of "$i") || die "node n$i is not running"
  kill "-$1" "$pid"
}

cmd_partition() {
  [ $# -ge 1 ] || die "usage: cluster.sh partition NODE..."
  need_netns
  local -A cut=()
  local x i j
  for x in "$@"; do i=$(node_index "$x") || exit 1; cut[$i]=1; done
  # Blackhole routes drop packets silently, as a real partition does: established
  # connections between the sides stall rather than reset. The /32 routes beat the bridge's
  # /24, and none touches the host's address.
  for ((i = 1; i <= $(size); i++)); do
    [ -n "${cut[$i]:-}" ] || continue
    for ((j = 1; j <= $(size); j++)); do
      [ -n "${cut[$j]:-}" ] && continue
      ip -n "$(ns "$i")" route replace blackhole "$(ip_of "$j")/32"
      ip -n "$(ns "$j")" route replace blackhole "$(ip_of "$i")/32"
    done
  done
}

cmd_heal() {
  local i r
  for ((i = 1; i <= $(size); i++)); do
    ip netns list | awk '{print $1}' | grep -qx "$(ns "$i")" || continue
    ip -n "$(ns "$i")" route show type blackhole | while read -r _ r _; do
      ip -n "$(ns "$i")" route del blackhole "$r"
    done
  done
}

cmd_down() {
  local i
  # Stop the nodes first (SIGTERM, bounded, then SIGKILL), then the network.
  for ((i = 1; i <= $(size); i++)); do kill_node "$i" TERM; done
  if command -v ip >/dev/null; then
    for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$BR-n[0-9]+$"); do
      # Any process still inside (started by hand) goes with its namespace.
      for pid in $(ip netns pids "$n" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
      ip netns del "$n"
    done
    for v in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 |
      grep -E "^${BR}v[0-9]+$"); do
      ip link del "$v" 2>/dev/null
    done
    ip link del "$BR" 2>/dev/null
  fi
  rm -rf "$STATE"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  up) cmd_up "$@" ;;
  status) cmd_status ;;
  kill) cmd_kill "$@" ;;
  start) cmd_start "$@" ;;
  pause) cmd_signal STOP "$@" ;;
  resume) cmd_signal CONT "$@" ;;
  partition) cmd_partition "$@" ;;
  heal) cmd_heal ;;
  down) cmd_down ;;
  *) die "usage: cluster.sh up N | status | kill NODE | start NODE | pause NODE | resume NODE | partition NODE... | heal | down" ;;
esac
