#!/usr/bin/env python3
"""Writes the normd wheel: the package of bindings/python with libnormclient inside.

    python3 bindings/python/build_wheel.py --library LIB --version VERSION \\
        --platform linux_x86_64 --out DIR

`make wheel` runs it with the library it links for the wheel (protobuf-c and
the CUDA runtime static, so the library needs only the C library; the CUDA
driver is opened with dlopen when a GPU is used). The wheel is
DIR/normd-VERSION-py3-none-PLATFORM.whl and holds:

- the packages pyproject.toml lists ([tool.setuptools] packages), their .py files;
- LIB as normd/libnormclient.so.0, which normd._lib loads before any other copy
  (only $NORMD_LIBRARY overrides it);
- the package data pyproject.toml lists ([tool.setuptools.package-data]: the
  eager operator's C++ source, which normd.eager compiles on first use) and,
  beside that source, client/include/normclient.h, which it includes;
- normd-VERSION.dist-info: METADATA from pyproject.toml and README.md, WHEEL
  (not pure: the tag names the platform; "py3-none" because the package is
  ctypes, bound to no Python ABI), RECORD, and licenses/ with the notices of
  what is linked into the library.

It uses the standard library alone (no setuptools, no wheel package, no
network), and the archive is reproducible: entries in a fixed order, every
timestamp SOURCE_DATE_EPOCH (default 1980-01-01), fixed permissions. Wheels
of other versions left in DIR are removed, so DIR holds one normd wheel.
"""

import argparse
import base64
import hashlib
import os
import sys
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The bundled library's name inside the wheel (normd._lib.BUNDLED_LIBRARY).
BUNDLED_NAME = "libnormclient.so.0"
#: Notices of the code linked into the bundled library: (file in HERE, name in licenses/).
#: The library's header, which the eager operator's source includes.
HEADER = HERE.parents[1] / "client" / "include" / "normclient.h"
LICENSES = [("licenses/protobuf-c.txt", "protobuf-c.txt")]


def load_pyproject(path):
    """pyproject.toml as a dict (tomllib: Python 3.11 or later, else the tomli package)."""
    try:
        import tomllib
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            sys.exit("build_wheel.py: reading pyproject.toml needs Python 3.11 (tomllib) or "
                     "the tomli package; run it with PYTHON=python3.11 make wheel")
    with open(path, "rb") as f:
        return tomllib.load(f)


def metadata(project, readme):
    """The METADATA file (core metadata 2.1) for pyproject's [project] table."""
    lines = ["Metadata-Version: 2.1", "Name: " + project["name"],
             "Version: " + project["version"], "Summary: " + project["description"]]
    if "requires-python" in project:
        lines.append("Requires-Python: " + project["requires-python"])
    lines += ["Requires-Dist: " + dep for dep in project.get("dependencies", [])]
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append("Provides-Extra: " + extra)
        lines += ['Requires-Dist: %s; extra == "%s"' % (dep, extra) for dep in deps]
    lines.append("Description-Content-Type: text/markdown")
    return ("\n".join(lines) + "\n\n" + readme).encode()


def package_files(packages):
    """(path in the wheel, file) for every .py file of the listed packages."""
    files = []
    for package in packages:
        folder = HERE.joinpath(*package.split("."))
        sources = sorted(folder.glob("*.py"))
        if not sources:
            sys.exit("build_wheel.py: package %s (pyproject.toml) has no .py files in %s"
                     % (package, folder))
        files += [("%s/%s" % (package.replace(".", "/"), f.name), f) for f in sources]
    return files


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (name, digest, len(data))


def write_wheel(path, entries, dist_info):
    """Writes entries [(name, bytes, mode)] and their RECORD to the zip file `path`."""
    epoch = max(int(os.environ.get("SOURCE_DATE_EPOCH", "315532800")), 315532800)
    stamp = time.gmtime(epoch)[:6]
    record = [record_line(name, data) for name, data, _ in entries]
    record.append("%s/RECORD,," % dist_info)
    entries = entries + [("%s/RECORD" % dist_info, ("\n".join(record) + "\n").encode(), 0o644)]
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data, mode in entries:
            info = zipfile.ZipInfo(name, stamp)
            info.external_attr = (0o100000 | mode) << 16  # a regular file and its mode
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    tmp.replace(path)


def package_data(globs):
    """(path in the wheel, file) for the [tool.setuptools.package-data] globs."""
    files = []
    for package, patterns in sorted(globs.items()):
        folder = HERE.joinpath(*package.split("."))
        for pattern in patterns:
            found = sorted(folder.glob(pattern))
            if not found:
                sys.exit("build_wheel.py: package data %s of %s matches nothing" % (pattern, package))
            files += [("%s/%s" % (package.replace(".", "/"), f.relative_to(folder).as_posix()), f)
                      for f in found]
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--library", required=True, help="the libnormclient.so to bundle")
    ap.add_argument("--version", required=True,
                    help="the Makefile's VERSION; pyproject.toml must say the same")
    ap.add_argument("--platform", required=True, help="the wheel's platform tag (linux_x86_64)")
    ap.add_argument("--out", required=True, help="the folder the wheel is written to")
    args = ap.parse_args()

    meta = load_pyproject(HERE / "pyproject.toml")
    project = meta["project"]
    name, version = project["name"], project["version"]
    if version != args.version:
        sys.exit("build_wheel.py: pyproject.toml says version %s, the Makefile's VERSION is %s; "
                 "change both (and normd/__init__.py's __version__)" % (version, args.version))
    dist_info = "%s-%s.dist-info" % (name, version)
    tag = "py3-none-" + args.platform

    setup = meta["tool"]["setuptools"]
    files = package_files(setup["packages"]) + package_data(setup.get("package-data", {}))
    files.append(("normd/csrc/normclient.h", HEADER))
    entries = [(arc, src.read_bytes(), 0o644) for arc, src in files]
    entries.append(("%s/%s" % (name, BUNDLED_NAME), Path(args.library).read_bytes(), 0o755))
    entries.sort()
    readme = (HERE / project.get("readme", "README.md")).read_text()
    entries.append(("%s/METADATA" % dist_info, metadata(project, readme), 0o644))
    wheel = ("Wheel-Version: 1.0\nGenerator: normd build_wheel.py\nRoot-Is-Purelib: false\n"
             "Tag: %s\n" % tag)
    entries.append(("%s/WHEEL" % dist_info, wheel.encode(), 0o644))
    for src, arc in LICENSES:
        entries.append(("%s/licenses/%s" % (dist_info, arc), (HERE / src).read_bytes(), 0o644))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / ("%s-%s-%s.whl" % (name, version, tag))
    for old in out.glob("%s-*.whl" % name):
        if old != target:
            old.unlink()
    write_wheel(target, entries, dist_info)
    print("wrote %s (%d files)" % (target, len(entries) + 1))


if __name__ == "__main__":
    main()
