#!/bin/sh
# The systemd files, checked offline (no systemd PID 1 needed):
# - `systemd-analyze verify` has nothing to say about normd@.service,
#   normd@.socket and normd-mps@.service (alone, and normd@ with the MPS
#   drop-in of docs/MPS.md) as `make install` writes them (installed under
#   a private prefix, so ExecStart= names a real binary and Documentation=
#   finds the installed man page); a deliberately broken copy does draw a
#   complaint, which shows the check looks;
# - normd@0.socket's path is the default socket of normd, normctl,
#   normstress and the Python package;
# - the unit keeps the settings the service depends on (notify, socket
#   activation, device access, sandbox, restarts);
# - systemd-sysusers and systemd-tmpfiles accept normd.sysusers and
#   normd.tmpfiles in a scratch root, creating the normd user and its
#   directories owned by it;
# - systemd/normd.conf lists every setting with its true default (compared
#   with `normd --print-config`), and loading it uncommented changes nothing.
. tests/service/lib.sh
P="$T/prefix"
# A stand-in for the driver's nvidia-cuda-mps-control (no driver here), so
# that normd-mps@.service names a real program.
mkdir "$T/driver"
printf '#!/bin/sh\nexit 0\n' >"$T/driver/nvidia-cuda-mps-control"
chmod 0755 "$T/driver/nvidia-cuda-mps-control"
make -s --no-print-directory B="$B" install PREFIX="$P" SYSCONFDIR="$P/etc" \
	MPS_CONTROL="$T/driver/nvidia-cuda-mps-control" >"$T/install.log" 2>&1 ||
	fail "make install PREFIX=$P"
U="$P/lib/systemd/system"

out=$(MANPATH="$P/share/man:" systemd-analyze verify "$U/normd@0.service" "$U/normd@0.socket" \
	"$U/normd@all.service" "$U/normd@cpu.socket" 2>&1) || fail "systemd-analyze verify: $out"
[ -z "$out" ] || fail "systemd-analyze verify reports: $out"
mkdir "$T/broken"
sed 's/^DevicePolicy=/DevicePolicyy=/' "$U/normd@.service" >"$T/broken/normd@.service"
cp "$U/normd@.socket" "$T/broken/"
out=$(MANPATH="$P/share/man:" systemd-analyze verify "$T/broken/normd@0.service" 2>&1)
case "$out" in *DevicePolicyy*) ;; *) fail "verify missed a broken key: $out" ;; esac
check "systemd-analyze verify: no findings on the installed units (and it does catch a bad key)"

svc="$U/normd@.service"
for line in Type=notify 'ExecStart=@P@/sbin/normd --config @P@/etc/normd/normd.conf --device %i --socket /run/normd/%i.sock' \
	Requires=normd@%i.socket User=normd DevicePolicy=closed 'DeviceAllow=char-nvidia rw' \
	'DeviceAllow=char-nvidiactl rw' 'DeviceAllow=char-nvidia-uvm rw' 'DeviceAllow=char-nvidia-caps r' \
	ProtectSystem=strict ProtectHome=yes NoNewPrivileges=yes StateDirectory=normd \
	RuntimeDirectory=normd RuntimeDirectoryPreserve=yes Restart=on-failure \
	StartLimitIntervalSec=120 StartLimitBurst=5 WatchdogSec=30; do
	want=$(echo "$line" | sed "s|@P@|$P|g")
	grep -qxF "$want" "$svc" || fail "normd@.service lacks '$want'"
done
grep -q '^PrivateDevices=' "$svc" && fail "PrivateDevices= would hide the GPUs"
for line in 'ListenStream=/run/normd/%i.sock' SocketMode=0660 SocketGroup=normd; do
	grep -qxF "$line" "$U/normd@.socket" || fail "normd@.socket lacks '$line'"
done
check "the units keep notify, socket activation, device access, sandbox and restart settings"

# One default socket: what normd@0.socket listens on is where the daemon, the
# tools and the Python package look when no --socket or $NORMD_SOCKET says.
unit0=$(sed -n 's|^ListenStream=\(.*\)%i\(.*\)$|\10\2|p' "$U/normd@.socket")
[ "$unit0" = /run/normd/0.sock ] || fail "normd@0.socket listens on '$unit0'"
daemon=$("$B/bin/normd" --config /dev/null --print-config | sed -n 's/^socket = //p')
[ "$daemon" = "$unit0" ] || fail "normd's default socket '$daemon' is not normd@0's '$unit0'"
grep -qx "#socket = $unit0" systemd/normd.conf || fail "normd.conf's socket is not $unit0"
if [ ! -e "$unit0" ]; then # (a host running normd@0 would answer instead)
	out=$(env -u NORMD_SOCKET "$B/bin/normctl" ping 2>&1)
	case "$out" in *"at $unit0:"*) ;; *) fail "normctl's default is not $unit0: $out" ;; esac
fi
out=$(env -u NORMD_SOCKET "$B/bin/normstress" --help 2>&1)
case "$out" in *"else $unit0)"*) ;; *) fail "normstress's default is not $unit0: $out" ;; esac
py=$(PYTHONPATH=bindings/python python3 -c 'from normd.client import DEFAULT_SOCKET; print(DEFAULT_SOCKET)' 2>&1) ||
	fail "python: $py"
[ "$py" = "$unit0" ] || fail "the Python package's default is '$py', not $unit0"
check "normd@0.socket, normd, normd.conf, normctl, normstress and the Python package share $unit0"

# NVIDIA MPS (docs/MPS.md): normd-mps@.service, and normd@.service with the
# drop-in docs/MPS.md gives, verify cleanly; normd orders itself after the
# MPS unit but does not require it (it must start without MPS).
mps="$U/normd-mps@.service"
for line in "ExecStart=$T/driver/nvidia-cuda-mps-control -f" \
	"ExecStop=/bin/sh -c 'echo quit | $T/driver/nvidia-cuda-mps-control'" \
	User=root Environment=CUDA_VISIBLE_DEVICES=%i \
	Environment=CUDA_MPS_PIPE_DIRECTORY=/run/normd/mps-%i \
	Environment=CUDA_MPS_LOG_DIRECTORY=/var/log/normd/mps-%i \
	RuntimeDirectory=normd/mps-%i LogsDirectory=normd/mps-%i; do
	grep -qxF "$line" "$mps" || fail "normd-mps@.service lacks '$line'"
done
grep -qx 'After=.* normd-mps@%i.service' "$svc" || fail "normd@.service is not ordered after normd-mps@%i"
grep -q '^\(Requires\|Requisite\|BindsTo\|Wants\)=.*normd-mps' "$svc" &&
	fail "normd@.service must not pull in or require normd-mps@"
mkdir -p "$U/normd@1.service.d"
sed -n '/^# BEGIN normd@.service.d\/mps.conf$/,/^# END$/p' docs/MPS.md | sed '1d;$d' |
	sed "s|@SBINDIR@|$P/sbin|g; s|@SYSCONFDIR@|$P/etc|g" >"$U/normd@1.service.d/mps.conf"
grep -qx 'Wants=normd-mps@%i.service' "$U/normd@1.service.d/mps.conf" ||
	fail "no drop-in found in docs/MPS.md: $(cat "$U/normd@1.service.d/mps.conf")"
out=$(MANPATH="$P/share/man:" systemd-analyze verify "$U/normd-mps@0.service" "$U/normd-mps@1.service" \
	"$U/normd@1.service" 2>&1) || fail "systemd-analyze verify (MPS): $out"
[ -z "$out" ] || fail "systemd-analyze verify reports (MPS): $out"
rm -r "$U/normd@1.service.d"
check "normd-mps@.service and normd@.service with docs/MPS.md's drop-in verify cleanly; normd does not require MPS"

R="$T/sysroot"
mkdir -p "$R/etc"
systemd-sysusers --root="$R" "$P/lib/sysusers.d/normd.conf" >"$T/sysusers.log" 2>&1 ||
	fail "systemd-sysusers: $(cat "$T/sysusers.log")"
uid=$(awk -F: '$1 == "normd" { print $3 }' "$R/etc/passwd")
gid=$(awk -F: '$1 == "normd" { print $3 }' "$R/etc/group")
[ -n "$uid" ] && [ -n "$gid" ] || fail "sysusers did not create user and group normd"
systemd-tmpfiles --root="$R" --create "$P/lib/tmpfiles.d/normd.conf" >"$T/tmpfiles.log" 2>&1 ||
	fail "systemd-tmpfiles: $(cat "$T/tmpfiles.log")"
[ "$(stat -c '%u:%g %a' "$R/run/normd")" = "$uid:$gid 755" ] || fail "/run/normd: $(stat -c '%u:%g %a' "$R/run/normd")"
[ "$(stat -c '%u:%g %a' "$R/var/lib/normd")" = "$uid:$gid 750" ] || fail "/var/lib/normd"
check "sysusers creates normd ($uid:$gid); tmpfiles creates /run/normd and /var/lib/normd for it"

# normd.conf: every "#name = value" line is a setting at its default.
"$B/bin/normd" --config /dev/null --print-config | grep -v '^#' | sed 's/ *$//' | sort \
	>"$T/defaults"
sed -n 's/^#\([a-z_]* =.*\)$/\1/p' systemd/normd.conf | sed 's/ *$//' | sort >"$T/listed"
diff -u "$T/defaults" "$T/listed" >"$T/conf.diff" ||
	fail "systemd/normd.conf and normd --print-config differ (update the file): $(cat "$T/conf.diff")"
sed 's/^#\([a-z_]* =\)/\1/' systemd/normd.conf >"$T/uncommented.conf"
"$B/bin/normd" --config "$T/uncommented.conf" --print-config | grep -v '^#' | sed 's/ *$//' |
	sort >"$T/loaded"
diff -u "$T/defaults" "$T/loaded" >"$T/conf.diff" || fail "uncommented normd.conf: $(cat "$T/conf.diff")"
cmp -s systemd/normd.conf "$P/etc/normd/normd.conf" || fail "installed normd.conf differs"
check "normd.conf lists all $(wc -l <"$T/defaults") settings at their defaults, and parses"
