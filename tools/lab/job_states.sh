# Sourced by queue.sh and train_standins.sh: `job_states JOBS_FILE` prints each job of a detached run from
# its state file (lines `name running|exit|skipped <value> [<epoch>]`): exit code and seconds taken, still
# running for how long, or skipped with the seconds of the lease that were left.
job_states() {
  awk -v now="$(date +%s)" '$2 == "running" { start[$1] = $3; order[++n] = $1 }
    $2 == "exit" { rc[$1] = $3; took[$1] = $4 - start[$1] }
    $2 == "skipped" { order[++n] = $1; skipped[$1] = $4 }
    END { for (i = 1; i <= n; i++) { j = order[i];
            if (j in skipped) printf "  %-28s skipped: %d s of the lease left\n", j, skipped[j];
            else if (j in rc) printf "  %-28s exit %s after %d s\n", j, rc[j], took[j];
            else printf "  %-28s running for %d s\n", j, now - start[j] } }' "$1" 2>/dev/null
}
