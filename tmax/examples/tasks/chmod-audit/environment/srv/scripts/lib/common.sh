# shared helpers
log() { echo "[$(date +%T)] $*"; }
