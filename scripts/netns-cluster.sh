#!/usr/bin/env bash
# A two-host test cluster on this machine: two network namespaces ("hosts") joined by a veth pair.
#
#   bash scripts/netns-cluster.sh up   [NAME] [RATE]   # hosts NAME-h0 (10.213.7.1) and NAME-h1 (10.213.7.2)
#   bash scripts/netns-cluster.sh shape NAME RATE|off  # token-bucket rate on the inter-host link, e.g. 10mbit
#   bash scripts/netns-cluster.sh link  NAME up|down   # take the inter-host link down (or back up)
#   bash scripts/netns-cluster.sh kill  NAME HOST      # SIGKILL every process inside NAME-hHOST (0 or 1)
#   bash scripts/netns-cluster.sh down  [NAME]         # kill what runs inside the hosts, remove them
#
# NAME defaults to "ptc" and must be short (interface names are at most 15 characters). Each host has `lo` up
# and one interface, `NAME-e0` / `NAME-e1`, in the private range 10.213.7.0/24 used only inside the namespaces;
# with ADDRESSES_PER_HOST=2 each host gets a second address (10.213.7.3 on h0, 10.213.7.4 on h1). The link is
# shaped with `tc ... tbf` on both ends (netem, delay, is not in this kernel). Needs root and `ip netns`.
# Run a command on a host with `ip netns exec NAME-h0 COMMAND`. Prints one status line on stdout.
set -euo pipefail

SUBNET=10.213.7
ACTION="${1:-}"
NAME="${2:-ptc}"

die() { echo "netns-cluster: $*" >&2; exit 1; }
[[ $NAME =~ ^[a-z][a-z0-9]{0,9}$ ]] || die "NAME must be 1-10 lowercase letters/digits, got '$NAME'"
[[ $(id -u) == 0 ]] || die "needs root (ip netns)"

host() { echo "$NAME-h$1"; }
dev() { echo "$NAME-e$1"; }

shape() {  # RATE on both ends of the link, or "off"
    local rate="$1" side
    for side in 0 1; do
        ip netns exec "$(host $side)" tc qdisc del dev "$(dev $side)" root 2>/dev/null || true
        if [[ $rate != off ]]; then
            ip netns exec "$(host $side)" tc qdisc add dev "$(dev $side)" root tbf rate "$rate" burst 32kbit \
                latency 400ms
        fi
    done
}

kill_host() {  # every process inside one namespace, at once
    local pids
    pids="$(ip netns pids "$(host "$1")" 2>/dev/null || true)"
    [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
}

case "$ACTION" in
    up)
        rate="${3:-off}"
        for side in 0 1; do
            ip netns list | grep -qw "$(host $side)" && die "$(host $side) exists already: run down $NAME first"
        done
        ip netns add "$(host 0)"
        ip netns add "$(host 1)"
        ip link add "$(dev 0)" netns "$(host 0)" type veth peer name "$(dev 1)" netns "$(host 1)"
        for side in 0 1; do
            ip -n "$(host $side)" link set lo up
            ip -n "$(host $side)" addr add "$SUBNET.$((side + 1))/24" dev "$(dev $side)"
            if [[ ${ADDRESSES_PER_HOST:-1} == 2 ]]; then
                ip -n "$(host $side)" addr add "$SUBNET.$((side + 3))/24" dev "$(dev $side)"
            fi
            ip -n "$(host $side)" link set "$(dev $side)" up
        done
        shape "$rate"
        echo "netns-cluster: up $(host 0)=$SUBNET.1 $(host 1)=$SUBNET.2 link $(dev 0)<->$(dev 1) rate $rate"
        ;;
    shape)
        [[ $# -ge 3 ]] || die "usage: shape NAME RATE|off"
        shape "$3"
        echo "netns-cluster: $NAME link rate $3"
        ;;
    link)
        [[ ${3:-} == up || ${3:-} == down ]] || die "usage: link NAME up|down"
        ip -n "$(host 0)" link set "$(dev 0)" "$3"
        echo "netns-cluster: $NAME link $3"
        ;;
    kill)
        [[ ${3:-} == 0 || ${3:-} == 1 ]] || die "usage: kill NAME 0|1"
        kill_host "$3"
        echo "netns-cluster: killed every process of $(host "$3")"
        ;;
    down)
        for side in 0 1; do
            kill_host "$side"
        done
        for side in 0 1; do
            ip netns del "$(host $side)" 2>/dev/null || true  # removing one end removes the veth pair
        done
        echo "netns-cluster: down $NAME"
        ;;
    *)
        die "usage: $0 up|shape|link|kill|down [NAME] ..."
        ;;
esac
