# Sourced by campaign.sh and queue.sh: `work_copy DIR` makes DIR/src a copy of the checkout (the
# current directory) without .git (the carried .source-commit binds the commit) and without the
# staged wheels; .stage/before stays (the fast-path probe reads it). A second call on the same warm
# machine keeps DIR/src/outputs (raw files not yet brought back, observed rates): only code is replaced.
work_copy() {
  local dir=$1
  [ -d "$dir/src/outputs" ] && mv "$dir/src/outputs" "$dir/outputs.keep"
  rm -rf "$dir/src" && mkdir -p "$dir" && cp -r . "$dir/src"
  rm -rf "$dir/src/.git" "$dir"/src/.stage/extras "$dir"/src/.stage/vllm-*
  if [ -d "$dir/outputs.keep" ]; then
    cp -rn "$dir/src/outputs/." "$dir/outputs.keep/" && rm -rf "$dir/src/outputs"
    mv "$dir/outputs.keep" "$dir/src/outputs"
  fi
}
