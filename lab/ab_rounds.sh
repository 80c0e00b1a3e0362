# Shared by the A/B tools (tune_ffma_hints.sh, ab_builds.sh): time variants of the built extension in alternating
# processes, because the same build moves by a few % between processes. A variant is "<name>[ <args>]": before
# each process SO_DIR/<name>.so is copied over the extension EXT_SO, and lab/time_m_grouped_rows.py <args>
# times `ours` on the five reference rows (docs/design.md §5). ROUNDS rounds, each in rotated order; one JSON line per process is appended
# to $D/times.jsonl (lab/ab_summary.py reads it), stderr to $D/err.log.
#   usage: source lab/ab_rounds.sh; time_rotated SO_DIR EXT_SO ROUNDS variant...
time_rotated() {
  local so_dir=$1 so=$2 rounds=$3
  shift 3
  local variants=("$@") n=$# r j v name
  for r in $(seq 0 $(( rounds - 1 ))); do
    for j in $(seq 0 $(( n - 1 ))); do
      v=${variants[$(( (j + r) % n ))]}
      name=${v%% *}
      cp "$so_dir/$name.so" "$so"
      # shellcheck disable=SC2086  # the variant's arguments split on purpose
      echo "{\"variant\": \"$v\", \"round\": $r, \"tflops\": $(python3 lab/time_m_grouped_rows.py ${v#"$name"} \
        2>>"$D/err.log" || echo null)}" >> "$D/times.jsonl"
    done
    echo "round $r done"
  done
}
