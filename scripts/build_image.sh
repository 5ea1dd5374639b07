#!/usr/bin/env bash
# Builds Meridian's container image (deploy/container/Containerfile) from Debian's packages and
# PyPI alone: no container registry is used.
#
#   1. the base: Debian bookworm made with debootstrap (minbase, plus python3, python3-venv and
#      ca-certificates) from the mirror apt uses, imported with podman as
#      localhost/meridian-base:bookworm. Skipped when that image exists, made by this recipe.
#   2. the image: the Containerfile built by buildah on that base (PYTHON_IMAGE), tagged
#      localhost/meridian:<version of pyproject.toml>. Its build stage downloads build, wheel
#      and Meridian's dependencies from the package index.
#
# The image's name is printed on stdout (the last line); the progress goes to stderr.
# `make test-image` runs this through tests/deploy/test_image.py and smoke-tests the result.
#
# Needs root (debootstrap, and podman's and buildah's system storage, /var/lib/containers)
# and debootstrap, buildah, podman and runc (Debian's packages: `make test-image` installs them).
#
# Environment, all optional:
#   MERIDIAN_IMAGE       the tag to build (default localhost/meridian:<version>)
#   MERIDIAN_BASE_IMAGE  the base's tag (default localhost/meridian-base:bookworm)
#   DEBIAN_MIRROR        debootstrap's mirror (default: the first one apt uses for bookworm, in
#                        /etc/apt/sources.list, sources.list.d/*.list or *.sources; else
#                        http://deb.debian.org/debian)
#   STORAGE_DRIVER       given to buildah and podman as --storage-driver (default: overlay
#                        where /var/lib/containers/storage holds overlay images or the kernel
#                        mounts an overlay there, vfs otherwise: no fuse needed). podman
#                        remembers a driver given on the storage's first use; give the same
#                        one to buildah and to podman afterwards.
#   REBUILD_BASE=1       debootstrap again even when the base exists
#   BUILDAH_RUNTIME      the OCI runtime of the build's RUN steps (default runc, see below)
# The build's RUN steps get the host's CA bundle (/etc/ssl/certs/ca-certificates.crt, bind
# mounted, not kept in the image: behind a TLS-intercepting proxy pip trusts what the host
# trusts), its proxy variables (buildah passes them through) and its package index
# (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST, PIP_DEFAULT_TIMEOUT, as /etc/pip.conf).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SUITE=bookworm
PACKAGES=python3,python3-venv,ca-certificates
# What the base is made of; a base labelled otherwise is made again.
RECIPE="debootstrap:$SUITE:minbase:$PACKAGES"
GRAPHROOT=/var/lib/containers/storage
HOST_CA=/etc/ssl/certs/ca-certificates.crt

log() { printf 'build_image: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# The --storage-driver to give buildah and podman, if any. None for overlay, their default:
# a storage that holds overlay images, or a fresh one where the kernel mounts an overlay. vfs
# where it does not (overlay on overlay: in a container, some VMs), as it needs no mount at
# all, and then on every run: podman's database remembers the driver, buildah does not.
storage_flags() {
  if [ -n "${STORAGE_DRIVER:-}" ]; then
    echo "--storage-driver=$STORAGE_DRIVER"
    return
  fi
  [ ! -d "$GRAPHROOT/overlay-images" ] || return 0
  if [ -d "$GRAPHROOT/vfs-images" ]; then
    echo "--storage-driver=vfs"
    return
  fi
  mkdir -p "$(dirname "$GRAPHROOT")"
  local probe works=""
  probe="$(mktemp -d "$(dirname "$GRAPHROOT")/.overlay-probe.XXXXXX")"
  mkdir "$probe/lower" "$probe/upper" "$probe/work" "$probe/merged"
  if mount -t overlay overlay \
      -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" "$probe/merged" \
      2>/dev/null; then
    touch "$probe/merged/written" 2>/dev/null && works=yes
    umount "$probe/merged"
  fi
  rm -rf "$probe"
  [ -n "$works" ] || echo "--storage-driver=vfs"
}

# The first http(s) mirror apt fetches $SUITE from: one-line sources first, then deb822.
apt_mirror() {
  local f found=""
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -r "$f" ] || continue
    found="$found$(awk -v suite="$SUITE" '
      $1 == "deb" {
        sub(/^deb[ \t]+(\[[^]]*\][ \t]+)?/, "")
        if ($2 == suite) print $1
      }' "$f")"$'\n'
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -r "$f" ] || continue
    found="$found$(awk -v suite="$SUITE" '
      function flush() {
        if (enabled != "no" && (" " types " ") ~ / deb / && (" " suites " ") ~ (" " suite " ")) {
          split(uris, u, " ")
          print u[1]
        }
        types = ""; uris = ""; suites = ""; enabled = ""
      }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      { key = tolower($1); $1 = "" }
      key == "types:" { types = $0 }
      key == "uris:" { uris = $0 }
      key == "suites:" { suites = $0 }
      key == "enabled:" { enabled = tolower($2) }
      END { flush() }' "$f")"$'\n'
  done
  local line
  while IFS= read -r line; do
    case "$line" in
      http://* | https://*) echo "${line%/}"; return ;;
    esac
  done <<<"$found"
  echo http://deb.debian.org/debian
}

[ $# -eq 0 ] || die "usage: $0 (no arguments; see its header for the environment)"
[ "$(id -u)" = 0 ] \
  || die "needs root (debootstrap; podman's system storage): run it as root or with sudo"
# runc, not crun (podman's and buildah's default in Debian): crun refuses a hybrid cgroup
# hierarchy (cgroup v1 with a controller left on v2, as on the development VM); runc runs on both.
RUNTIME="${BUILDAH_RUNTIME:-runc}"
for tool in debootstrap buildah podman "$RUNTIME"; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null \
    || die "$tool is missing (Debian's package $tool; make test-image installs it)"
done
export PATH="$PATH:/usr/sbin:/sbin"

VERSION="$(awk -F'"' '/^version = "/ { print $2; exit }' "$ROOT/pyproject.toml")"
[ -n "$VERSION" ] || die "no version in pyproject.toml"
IMAGE="${MERIDIAN_IMAGE:-localhost/meridian:$VERSION}"
BASE="${MERIDIAN_BASE_IMAGE:-localhost/meridian-base:$SUITE}"
REVISION="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
STORAGE="$(storage_flags)"
podman() { command podman ${STORAGE:+"$STORAGE"} "$@"; }
buildah() { command buildah ${STORAGE:+"$STORAGE"} "$@"; }
log "storage: $(podman info --format '{{.Store.GraphDriverName}} in {{.Store.GraphRoot}}')"

work="$(mktemp -d "${TMPDIR:-/tmp}/meridian-image.XXXXXX")"
cleanup() {
  # What a failed debootstrap may leave mounted in the root filesystem (proc, sys, a bound
  # /dev) is unmounted first, and rm never leaves the temporary directory's filesystem.
  awk -v dir="$work/" 'index($2, dir) == 1 { print $2 }' /proc/self/mounts | sort -r \
    | while read -r mounted; do umount -l "$mounted" || true; done
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT

# -- 1. the base ---------------------------------------------------------------------------
have_recipe=""
previous_base=""
status=0
podman image exists "$BASE" || status=$?
case "$status" in
  0) have_recipe="$(podman image inspect "$BASE" \
    --format '{{index .Labels "meridian.base.recipe"}}')" ;;
  1) ;; # not there
  *) die "podman image exists $BASE failed (exit $status): the storage above is not usable" ;;
esac
if [ "$have_recipe" = "$RECIPE" ] && [ "${REBUILD_BASE:-0}" != 1 ]; then
  log "base $BASE exists ($RECIPE): debootstrap skipped"
else
  mirror="${DEBIAN_MIRROR:-$(apt_mirror)}"
  log "debootstrap $SUITE (minbase + $PACKAGES) from $mirror"
  started=$SECONDS
  previous_base="$(podman image inspect --format '{{.Id}}' "$BASE" 2>/dev/null || true)"
  rootfs="$work/rootfs"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$mirror" >&2
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old
  rm -f "$rootfs/etc/hostname"
  : >"$rootfs/etc/resolv.conf" # podman mounts its own
  tar --numeric-owner --xattrs -C "$rootfs" -c . \
    | podman import \
      --change 'CMD ["/bin/bash"]' \
      --change "LABEL meridian.base.recipe=$RECIPE" \
      --change "LABEL meridian.base.mirror=$mirror" \
      --message "$RECIPE from $mirror" - "$BASE" >&2
  rm -rf --one-file-system "$rootfs"
  log "base $BASE imported in $((SECONDS - started)) s"
fi

# -- 2. the image --------------------------------------------------------------------------
mounts=()
if [ -r "$HOST_CA" ]; then
  mounts+=(--volume "$HOST_CA:$HOST_CA:ro")
fi
pip_conf=""
[ -z "${PIP_INDEX_URL:-}" ] || pip_conf+="index-url = $PIP_INDEX_URL"$'\n'
[ -z "${PIP_EXTRA_INDEX_URL:-}" ] || pip_conf+="extra-index-url = $PIP_EXTRA_INDEX_URL"$'\n'
[ -z "${PIP_TRUSTED_HOST:-}" ] || pip_conf+="trusted-host = $PIP_TRUSTED_HOST"$'\n'
[ -z "${PIP_DEFAULT_TIMEOUT:-}" ] || pip_conf+="timeout = $PIP_DEFAULT_TIMEOUT"$'\n'
if [ -n "$pip_conf" ]; then
  printf '[global]\n%s' "$pip_conf" >"$work/pip.conf"
  chmod 0644 "$work/pip.conf"
  mounts+=(--volume "$work/pip.conf:/etc/pip.conf:ro")
fi

previous="$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
log "building $IMAGE on $BASE (revision $REVISION)"
started=$SECONDS
buildah bud --pull=never --layers=false --runtime "$RUNTIME" \
  --build-arg "PYTHON_IMAGE=$BASE" \
  --build-arg "VERSION=$VERSION" \
  --build-arg "REVISION=$REVISION" \
  "${mounts[@]}" \
  -f "$ROOT/deploy/container/Containerfile" -t "$IMAGE" "$ROOT" >&2
log "built $IMAGE in $((SECONDS - started)) s"
current="$(podman image inspect --format '{{.Id}}' "$IMAGE")"
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
  # The image this tag named before: untagged now, so dropped (unless a container uses it).
  podman rmi "$previous" >/dev/null 2>&1 || true
fi
# The base made before, if it was made again: dropped now that no image of ours stands on it.
[ -z "$previous_base" ] || podman rmi "$previous_base" >/dev/null 2>&1 || true
echo "$IMAGE"
