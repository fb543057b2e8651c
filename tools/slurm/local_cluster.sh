#!/usr/bin/env bash
# A one-machine SLURM cluster, to try tools/slurm/dtrain.sbatch without a real one (the tests
# use it): Debian's slurm-wlm and munge (apt-get install slurm-wlm munge), run as root.
#
#   sudo tools/slurm/local_cluster.sh /tmp/slurm   # writes /tmp/slurm/slurm.conf, starts
#   export SLURM_CONF=/tmp/slurm/slurm.conf        # munged, slurmctld and slurmd; then sbatch
#   sudo tools/slurm/local_cluster.sh /tmp/slurm stop
#
# This machine is the controller and the one compute node, with its CPUs and memory as slurmd
# reads them; jobs may be requeued (the preemption path of dtrain.sbatch) and start again about
# 10 s after.
set -euo pipefail
dir=$(realpath -m "${1:?usage: local_cluster.sh DIR [stop]}")
if [ "${2:-}" = stop ]; then
    for daemon in slurmd slurmctld; do
        [ -f "$dir/$daemon.pid" ] && kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
    done
    exit 0
fi
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
host=$(hostname -s)
# This machine by name and at the loopback address, whether or not its name resolves.
node=$(slurmd -C | head -n1 | sed "s/^NodeName=[^ ]*/NodeName=$host NodeAddr=127.0.0.1/")
cat > "$dir/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job starts once its old credential expires (default 120 s): 10 s here.
AuthInfo=cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=60
$node State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$dir/slurm.conf"
if ! pgrep -x munged > /dev/null; then
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- /usr/sbin/munged
fi
slurmctld
slurmd
for _ in $(seq 60); do  # the node is up when it takes jobs
    if sinfo -h -N -o %t 2>/dev/null | grep -qE "^(idle|mix|alloc)"; then
        echo "local SLURM cluster up: export SLURM_CONF=$SLURM_CONF"; exit 0
    fi
    sleep 1
done
echo "local_cluster.sh: the node did not come up; see $dir/log" >&2
exit 1
