//! Shell scripts that stand in for quiver-server and quiver-router. Each records its arguments
//! and pid in `$FAKE_OUT`, then announces `<name> ready` on the `$FAKE_EVENTS` fifo, so a test
//! waits for that line rather than polling for the files. Lines this short are written to a
//! fifo in one piece, so children announcing at once do not interleave.

/// `quiver-server`: `demo-model DIR` writes a config.json and the demo version the launcher
/// expects (`launcher/src/demo.rs`); `serve` records itself as
/// `shard-<rank>`, exits with $FAKE_SHARD_EXIT if set, else runs until SIGTERM and records in
/// `shard-<rank>.stopped` whether the router had stopped before it.
pub const FAKE_SERVER: &str = r#"#!/bin/sh
if [ "$1" = "demo-model" ]; then
  mkdir -p "$2/adapters/quiver-demo-pirate" && echo '{}' > "$2/config.json" && echo 3 > "$2/quiver-demo-version"
  exit 0
fi
rank=x; prev=
for a in "$@"; do [ "$prev" = "--rank" ] && rank="$a"; prev="$a"; done
on_term() {
  if [ -e "$FAKE_OUT/router.stopped" ]; then order=after-router; else order=before-router; fi
  echo "$order" > "$FAKE_OUT/shard-$rank.stopped"
  kill "$sleeper" 2>/dev/null
  exit 0
}
# Before the announcement: the tests signal as soon as they see it.
trap on_term TERM
echo $$ > "$FAKE_OUT/shard-$rank.pid"
printf '%s\n' "$@" > "$FAKE_OUT/shard-$rank.args"
echo "shard-$rank ready" > "$FAKE_EVENTS"
echo '{"level":"INFO","message":"fake shard loading","target":"fake"}' >&2
if [ -n "$FAKE_SHARD_EXIT" ]; then exit "$FAKE_SHARD_EXIT"; fi
# Stays alive until told to stop; the sleep is a lifetime, not a wait for anything.
sleep 600 & sleeper=$!
wait "$sleeper"
"#;

/// `quiver-router`: records itself as `router`, exits with $FAKE_ROUTER_EXIT if set, ignores
/// SIGTERM (a drain that never ends) if $FAKE_ROUTER_IGNORE_TERM is set, else runs until
/// SIGTERM and leaves `router.stopped` behind.
pub const FAKE_ROUTER: &str = r#"#!/bin/sh
# Before the announcement: the tests signal as soon as they see it.
if [ -n "$FAKE_ROUTER_IGNORE_TERM" ]; then
  trap '' TERM
else
  trap 'touch "$FAKE_OUT/router.stopped"; kill "$sleeper" 2>/dev/null; exit 0' TERM
fi
echo $$ > "$FAKE_OUT/router.pid"
printf '%s\n' "$@" > "$FAKE_OUT/router.args"
echo "router ready" > "$FAKE_EVENTS"
if [ -n "$FAKE_ROUTER_EXIT" ]; then exit "$FAKE_ROUTER_EXIT"; fi
# Ignored SIGTERM carries over the exec; only the launcher's SIGKILL ends this one.
if [ -n "$FAKE_ROUTER_IGNORE_TERM" ]; then exec sleep 600; fi
sleep 600 & sleeper=$!
wait "$sleeper"
"#;
