# Sourced by the scripts/dev/gpu_*.sh scripts: with SNAPSHOT=FILE.tgz, $OUT is archived into FILE every
# SNAPSHOT_EVERY seconds (default 30) and when the script ends, so a device call cut at its time limit still brings
# back one archive of everything written so far (the tool returns at most 8 files: keep $OUT outside the tool's
# folder and SNAPSHOT inside it). Usage in a device command:
#   SNAPSHOT=$OUT/r.tgz OUT=/tmp/w bash scripts/dev/gpu_sampling.sh
snap() {
  [ -n "${SNAPSHOT:-}" ] || return 0
  tar czf "$SNAPSHOT.tmp" -C "$OUT" . 2>/dev/null && mv -f "$SNAPSHOT.tmp" "$SNAPSHOT"
}
if [ -n "${SNAPSHOT:-}" ]; then
  ( while sleep "${SNAPSHOT_EVERY:-30}"; do snap; done ) &
  SNAPSHOT_LOOP=$!
  trap 'kill $SNAPSHOT_LOOP 2>/dev/null; snap' EXIT
fi
