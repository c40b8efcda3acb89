#!/bin/sh
# Open MPI's remote-start agent for the two-host test cluster (scripts/netns-cluster.sh), in place of ssh: mpirun,
# started on host 0 with `--mca plm_rsh_agent scripts/netns-rsh.sh`, calls `netns-rsh.sh HOST COMMAND...` to start
# its daemon on HOST; this runs COMMAND in HOST's network namespace. No sshd, no keys. The cluster's NAME comes
# from NETNS_CLUSTER in mpirun's environment; HOST is one of the cluster's addresses (10.213.7.1-4).
set -eu
name="${NETNS_CLUSTER:?netns-rsh: export NETNS_CLUSTER=<cluster name> for mpirun}"
host="$1"
shift
case "$host" in
    10.213.7.1 | 10.213.7.3) namespace="$name-h0" ;;
    10.213.7.2 | 10.213.7.4) namespace="$name-h1" ;;
    *) echo "netns-rsh: $host is not a host of cluster $name (10.213.7.1-4)" >&2; exit 1 ;;
esac
exec ip netns exec "$namespace" /bin/sh -c "$*"
