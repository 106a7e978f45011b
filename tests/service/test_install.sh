#!/bin/sh
# `make install DESTDIR=... PREFIX=/usr` puts every file where a distribution
# package would, with a versioned shared library behind its soname links, a
# pkg-config file that finds the installed header and library, and units
# that name the installed daemon. Then a program built only through
# `pkg-config --cflags --libs normclient` (dynamically, and statically)
# talks to the installed normd and runs a job. `make uninstall` removes it
# all but the config file.
. tests/service/lib.sh
D="$T/root"
make -s --no-print-directory B="$B" install DESTDIR="$D" PREFIX=/usr >"$T/install.log" 2>&1 ||
	fail "make install"

for f in usr/sbin/normd usr/bin/normctl usr/bin/normstress \
	usr/lib/libnormclient.so.0.1.0 usr/lib/libnormclient.a usr/include/normclient.h \
	usr/lib/pkgconfig/normclient.pc usr/lib/systemd/system/normd@.service \
	usr/lib/systemd/system/normd@.socket usr/lib/sysusers.d/normd.conf \
	usr/lib/tmpfiles.d/normd.conf etc/normd/normd.conf usr/share/man/man8/normd.8 \
	usr/share/man/man1/normctl.1 usr/share/man/man1/normstress.1 \
	usr/share/man/man3/libnormclient.3; do
	[ -f "$D/$f" ] || fail "not installed: /$f"
done
check "every file installed under DESTDIR"
[ "$(readlink "$D/usr/lib/libnormclient.so.0")" = libnormclient.so.0.1.0 ] &&
	[ "$(readlink "$D/usr/lib/libnormclient.so")" = libnormclient.so.0 ] ||
	fail "libnormclient.so symlinks"
readelf -d "$D/usr/lib/libnormclient.so.0.1.0" | grep -q 'SONAME.*\[libnormclient.so.0\]' ||
	fail "soname is not libnormclient.so.0"
check "libnormclient.so.0.1.0, soname libnormclient.so.0, .so -> .so.0 -> .so.0.1.0"
grep -qx 'ExecStart=/usr/sbin/normd --config /etc/normd/normd.conf --device %i --socket /run/normd/%i.sock' \
	"$D/usr/lib/systemd/system/normd@.service" || fail "ExecStart does not name /usr/sbin/normd"
grep -q '@[A-Z]*@' "$D/usr/lib/systemd/system/normd@.service" "$D/usr/lib/pkgconfig/normclient.pc" &&
	fail "a template placeholder was left in an installed file"
check "units and pkg-config file carry the install paths"
for page in "$D"/usr/share/man/man*/*; do
	w=$(LC_ALL=C.UTF-8 groff -man -ww -z -Tutf8 "$page" 2>&1)
	[ -z "$w" ] || fail "groff warns about $page: $w"
done
check "man pages render without warnings"

# Build a client the way a user would: pkg-config over the staged tree.
export PKG_CONFIG_PATH="$D/usr/lib/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$D"
[ "$(pkg-config --modversion normclient)" = 0.1.0 ] || fail "pkg-config --modversion"
flags=$(pkg-config --cflags --libs normclient) || fail "pkg-config --cflags --libs"
case "$flags" in *"-I$D/usr/include"*"-L$D/usr/lib"*) ;; *) fail "pkg-config gave: $flags" ;; esac
cc -std=c11 -Wall -Wextra -Werror -o "$T/smoke" tests/service/install_smoke.c $flags -lm \
	>"$T/cc.log" 2>&1 || fail "building against the installed library"
readelf -d "$T/smoke" | grep -q 'NEEDED.*\[libnormclient.so.0\]' ||
	fail "the program does not need libnormclient.so.0"
static_libs=$(pkg-config --static --libs normclient | sed "s|-lnormclient|-l:libnormclient.a|")
cc -std=c11 -Wall -Wextra -Werror -o "$T/smoke-static" tests/service/install_smoke.c \
	$(pkg-config --cflags normclient) $static_libs -lm >"$T/cc-static.log" 2>&1 ||
	fail "static link with pkg-config --static"
readelf -d "$T/smoke-static" | grep -q 'libnormclient' && fail "the static build needs the .so"
check "a client builds with pkg-config against the installed header and library (shared and static)"

# Run it against the installed daemon.
"$D/usr/sbin/normd" --config "$D/etc/normd/normd.conf" --device cpu --socket "$T/n.sock" \
	2>"$T/normd.log" &
DAEMON_PID=$!
wait_socket "$T/n.sock" || fail "the installed normd did not start"
LD_LIBRARY_PATH="$D/usr/lib" "$T/smoke" "$T/n.sock" >"$T/smoke.log" 2>&1 ||
	fail "the installed client library could not run a job: $(cat "$T/smoke.log")"
LD_LIBRARY_PATH="$D/usr/lib" ldd "$T/smoke" | grep -q "libnormclient.so.0 => $D/usr/lib/" ||
	fail "the program did not load the installed libnormclient"
"$T/smoke-static" "$T/n.sock" >>"$T/smoke.log" 2>&1 || fail "the static client: $(cat "$T/smoke.log")"
check "$(head -n 1 "$T/smoke.log") (installed normd, installed library)"
kill -TERM "$DAEMON_PID"
wait_exit "$DAEMON_PID"
[ "$WAIT_RC" -eq 0 ] || fail "normd exited with $WAIT_RC"

make -s --no-print-directory B="$B" uninstall DESTDIR="$D" PREFIX=/usr >>"$T/install.log" 2>&1 ||
	fail "make uninstall"
left=$(cd "$D" && find . -type f -o -type l)
[ "$left" = "./etc/normd/normd.conf" ] || fail "uninstall left: $left"
check "make uninstall removes everything but the config file"
