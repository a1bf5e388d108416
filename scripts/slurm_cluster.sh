#!/usr/bin/env bash
# A two-node Slurm cluster on this machine, for trying `torchx run -s slurm` and for the tests.
#
#   scripts/slurm_cluster.sh start    # prints the `export SLURM_CONF=...` line to use it
#   scripts/slurm_cluster.sh status
#   scripts/slurm_cluster.sh stop     # stops every daemon it started, by process id
#   scripts/slurm_cluster.sh kill-node n2 | restore-node n2   # a lost node, and back
#
# Daemons (each in the foreground of a background job, its pid in $DIR/pids/<name>):
#   munged (its own socket and key), mariadbd + slurmdbd (accounting: torchx's status and
#   describe run `sacct`, which reads the accounting database; a real cluster runs slurmdbd
#   for the same reason), slurmctld, and two slurmd, `-N n1` and `-N n2`.
# Nodes: n1 and n2 are both this machine. Slurm reaches them at NodeAddr 127.0.1.1 and
# 127.0.1.2; their names resolve (an /etc/hosts line this script adds) to this machine's
# address, so that torchrun's rendezvous on `n1:<port>` finds its store and its
# is-this-host test holds on the node that hosts it. The line stays after `stop` (another
# cluster may be using it; it only names this machine).
#
# Environment: PROACTIVE_SLURM_DIR (state, config, logs; default /tmp/proactive-slurm),
# PROACTIVE_SLURM_PORT (base port P: slurmctld P, slurmd P+1 and P+2, slurmdbd P+3,
# mariadb P+4; default 17000). Needs root and Debian's slurm-wlm munge slurmdbd
# mariadb-server (.ci/run installs them).
set -euo pipefail

DIR="${PROACTIVE_SLURM_DIR:-/tmp/proactive-slurm}"
PORT="${PROACTIVE_SLURM_PORT:-17000}"
CLUSTER=proactive
HOSTS_TAG="# proactive-slurm test nodes"
PACKAGES="slurm-wlm munge slurmdbd mariadb-server"

die() { echo "slurm_cluster.sh: $*" >&2; exit 2; }

pid_of() { [[ -f "$DIR/pids/$1" ]] && cat "$DIR/pids/$1"; }
alive() { local p; p=$(pid_of "$1") && [[ -n "$p" ]] && kill -0 "$p" 2>/dev/null; }

# Starts "$@" in the background, recording its pid under $DIR/pids/$name.
spawn() {
    local name=$1; shift
    "$@" >>"$DIR/log/$name.out" 2>&1 </dev/null &
    echo $! >"$DIR/pids/$name"
}

# Waits until "$@" succeeds (up to $1 seconds), or fails naming $2's log.
wait_for() {
    local secs=$1 name=$2; shift 2
    local end=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        alive "$name" || die "$name exited; see $DIR/log/$name.out"
        ((SECONDS < end)) || die "$name not ready after ${secs}s; see $DIR/log/$name.out"
        sleep 0.2
    done
}

write_config() {
    local mem cpus host
    host=$(hostname -s)
    cpus=$(nproc)
    # Each node may use half the machine's memory (both nodes are this machine).
    mem=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) / 2 ))
    cat >"$DIR/slurm.conf" <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
# No cgroups here: processes are tracked through /proc, tasks are not confined.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
# torchx submits a multi-node app as a heterogeneous job, which only the backfill scheduler
# starts, once per bf_interval (30 s by default): a job (or a requeued one) would wait up to
# 30 s for nothing on this idle cluster.
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# A lost node is noticed within seconds (a real cluster waits minutes).
SlurmdTimeout=10
MessageTimeout=10
KillWait=30
MinJobAge=300
JobRequeue=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 3))
# The munge socket for talking to slurmdbd (Slurm's name for it is the "password")
AccountingStoragePass=$DIR/munge.socket
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=n1 NodeAddr=127.0.1.1 NodeHostname=$host Port=$((PORT + 1)) CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=n2 NodeAddr=127.0.1.2 NodeHostname=$host Port=$((PORT + 2)) CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    cat >"$DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.socket
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$((PORT + 3))
SlurmUser=root
PidFile=$DIR/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT + 4))
StorageUser=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DIR/slurmdbd.conf"  # slurmdbd refuses a config others can read
}

add_hosts() {
    grep -q "$HOSTS_TAG" /etc/hosts && return 0
    printf '127.0.0.1 n1 n2 %s\n' "$HOSTS_TAG" >>/etc/hosts
}

# The processes of this cluster's jobs (their environment names its config and a job id,
# or they are a slurmstepd, whose environment names the config); with a node name, only
# those of that node: its tasks and the slurmstepd above them.
job_pids() {
    local node=${1:-} env p cmd vars
    for env in /proc/[0-9]*/environ; do
        p=${env#/proc/}; p=${p%/environ}
        vars=$( { tr '\0' '\n' <"$env"; } 2>/dev/null) || continue
        grep -qx "SLURM_CONF=$DIR/slurm.conf" <<<"$vars" || continue
        cmd=$( { tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null) || continue
        if [[ -z $node ]]; then
            if [[ $cmd == slurmstepd* ]] || grep -q '^SLURM_JOB_ID=' <<<"$vars"; then echo "$p"; fi
        elif grep -qx "SLURMD_NODENAME=$node" <<<"$vars"; then
            echo "$p"
            local parent; parent=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null) || continue
            [[ $( { tr '\0' ' ' <"/proc/$parent/cmdline"; } 2>/dev/null) == slurmstepd* ]] && echo "$parent"
        fi
    done | sort -u
}

# A node lost: its slurmd and everything it runs, killed at once (SIGKILL).
kill_node() {
    local node=$1 p
    p=$(pid_of "slurmd-$node") || die "no slurmd-$node started here"
    local victims; victims=$(job_pids "$node")
    kill -9 "$p" $victims 2>/dev/null || true
    rm -f "$DIR/pids/slurmd-$node"
    echo "killed slurmd-$node (pid $p) and its job processes: ${victims//$'\n'/ }"
}

# The node back: its slurmd restarted, and the node returned to service.
restore_node() {
    local node=$1
    alive "slurmd-$node" && return 0
    export SLURM_CONF="$DIR/slurm.conf"
    spawn "slurmd-$node" slurmd -D -N "$node" -f "$DIR/slurm.conf"
    scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
    wait_for 60 "slurmd-$node" nodes_idle
}

start() {
    [[ $(id -u) == 0 ]] || die "needs root (slurmd runs jobs as their users)"
    for b in munged mariadbd mariadb-install-db slurmdbd slurmctld slurmd sacctmgr; do
        command -v "$b" >/dev/null || die "$b not found: apt-get install -y $PACKAGES"
    done
    if alive slurmctld; then echo "export SLURM_CONF=$DIR/slurm.conf"; return 0; fi
    stop >/dev/null 2>&1 || true
    rm -rf "$DIR"
    mkdir -p "$DIR"/{pids,log,state,spool/n1,spool/n2,db}
    add_hosts
    write_config
    export SLURM_CONF="$DIR/slurm.conf"

    dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
    chmod 400 "$DIR/munge.key"
    spawn munged munged --foreground --force --socket="$DIR/munge.socket" --key-file="$DIR/munge.key" \
        --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munged.seed"
    wait_for 20 munged test -S "$DIR/munge.socket"

    mariadb-install-db --no-defaults --datadir="$DIR/db" --user=root --auth-root-authentication-method=normal \
        --skip-test-db >"$DIR/log/mariadb-install.out" 2>&1 || die "mariadb-install-db failed; see $DIR/log/mariadb-install.out"
    spawn mariadbd mariadbd --no-defaults --datadir="$DIR/db" --socket="$DIR/mysql.sock" --port=$((PORT + 4)) \
        --bind-address=127.0.0.1 --pid-file="$DIR/mariadbd.pid" --user=root --skip-name-resolve \
        --innodb-use-native-aio=0 --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 --log-error="$DIR/log/mariadbd.log"
    wait_for 60 mariadbd mariadb --no-defaults -S "$DIR/mysql.sock" -uroot -e "select 1"
    mariadb --no-defaults -S "$DIR/mysql.sock" -uroot -e \
        "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"

    spawn slurmdbd slurmdbd -D  # reads slurmdbd.conf beside $SLURM_CONF
    wait_for 60 slurmdbd sacctmgr -n list cluster
    sacctmgr -i add cluster "$CLUSTER" >/dev/null

    spawn slurmctld slurmctld -D -i -f "$DIR/slurm.conf"
    wait_for 60 slurmctld scontrol ping
    for n in n1 n2; do
        spawn "slurmd-$n" slurmd -D -N "$n" -f "$DIR/slurm.conf"
    done
    wait_for 60 slurmd-n1 nodes_idle
    echo "export SLURM_CONF=$DIR/slurm.conf"
}

nodes_idle() {
    [[ $(sinfo -h -N -o '%N %t' | grep -c ' idle') == 2 ]]
}

stop() {
    # Jobs first, while slurmctld can still end them; then the daemons, newest first.
    if alive slurmctld; then
        export SLURM_CONF="$DIR/slurm.conf"
        scancel --full -u root >/dev/null 2>&1 || true
        for _ in $(seq 50); do [[ -z $(squeue -h 2>/dev/null) ]] && break; sleep 0.2; done
    fi
    local name p
    for name in slurmd-n2 slurmd-n1 slurmctld slurmdbd mariadbd munged; do
        p=$(pid_of "$name") || continue
        kill "$p" 2>/dev/null || true
    done
    for name in slurmd-n2 slurmd-n1 slurmctld slurmdbd mariadbd munged; do
        p=$(pid_of "$name") || continue
        for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$p" 2>/dev/null || true
        rm -f "$DIR/pids/$name"
    done
    # Job steps a killed slurmd left behind: slurmstepd and its tasks, found by this
    # cluster's config in their environment (never the caller's shell: it has no job id).
    for p in $(job_pids); do kill -9 "$p" 2>/dev/null || true; done
}

status() {
    local name ok=0
    for name in munged mariadbd slurmdbd slurmctld slurmd-n1 slurmd-n2; do
        if alive "$name"; then echo "$name running (pid $(pid_of "$name"))"; else echo "$name stopped"; ok=1; fi
    done
    if alive slurmctld; then SLURM_CONF="$DIR/slurm.conf" sinfo -N; fi
    return $ok
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    kill-node) kill_node "${2:?node name}" ;;
    restore-node) restore_node "${2:?node name}" ;;
    *) die "usage: $0 start|stop|status|kill-node NODE|restore-node NODE" ;;
esac
