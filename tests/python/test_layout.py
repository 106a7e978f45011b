"""The ctypes mirrors match client/include/normclient.h.

A probe program is generated from the mirrors themselves (every struct,
every field), compiled against the real header with the C compiler, and
run: it prints sizeof, _Alignof and offsetof as the C compiler sees them,
and the values of the enums and constants the package copies.
"""

import ctypes
import os
import shutil
import subprocess

import pytest
from conftest import REPO

from normd import _lib


def _probe_source():
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "normclient.h"',
             "int main(void) {"]
    for name, cls in _lib.STRUCTS.items():
        lines.append('printf("size %s %%zu\\n", sizeof(struct %s));' % (name, name))
        lines.append('printf("align %s %%zu\\n", _Alignof(struct %s));' % (name, name))
        for field, _ in cls._fields_:
            lines.append('printf("offset %s.%s %%zu\\n", offsetof(struct %s, %s));'
                         % (name, field, name, field))
            lines.append('printf("fieldsize %s.%s %%zu\\n", sizeof(((struct %s *)0)->%s));'
                         % (name, field, name, field))
    constants = {"NC_%s" % op.name: op.value for op in _lib.Op}
    constants.update({"NC_%s" % dt.name: dt.value for dt in _lib.DType})
    constants.update({"NC_E%s" % name: code for name, code in _lib.STATUS_CODES.items()
                      if name != "OK"})
    constants.update(NC_OK=0, NC_MEMORY_EFFICIENT=_lib.MEMORY_EFFICIENT,
                     NC_ACCUMULATE=_lib.ACCUMULATE, NC_OVERWRITE=_lib.OVERWRITE,
                     NC_STATS_OPS=_lib.STATS_OPS, NC_STATS_DEVICES=_lib.STATS_DEVICES,
                     NC_LATENCY_BUCKETS=_lib.LATENCY_BUCKETS, NC_JOB_TENSORS=_lib.JOB_TENSORS)
    for name in constants:
        lines.append('printf("const %s %%lld\\n", (long long)(%s));' % (name, name))
    lines += ["return 0;", "}"]
    return "\n".join(lines) + "\n", constants


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    cc = os.environ.get("CC", "cc")
    if not shutil.which(cc):
        pytest.fail("no C compiler (%s) to build the layout probe" % cc)
    folder = tmp_path_factory.mktemp("probe")
    source, constants = _probe_source()
    (folder / "probe.c").write_text(source)
    exe = folder / "probe"
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", str(REPO / "client" / "include"),
                    str(folder / "probe.c"), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    facts = {}
    for line in out.splitlines():
        kind, key, value = line.split()
        facts[(kind, key)] = int(value)
    return facts, constants


@pytest.mark.parametrize("name", sorted(_lib.STRUCTS))
def test_struct_layout(probe, name):
    facts, _ = probe
    cls = _lib.STRUCTS[name]
    assert ctypes.sizeof(cls) == facts[("size", name)], "sizeof(struct %s)" % name
    assert ctypes.alignment(cls) == facts[("align", name)], "_Alignof(struct %s)" % name
    for field, ctype in cls._fields_:
        key = "%s.%s" % (name, field)
        assert getattr(cls, field).offset == facts[("offset", key)], "offsetof " + key
        assert ctypes.sizeof(ctype) == facts[("fieldsize", key)], "sizeof " + key


def test_constants(probe):
    facts, constants = probe
    for name, value in constants.items():
        assert int(value) == facts[("const", name)], name


def test_every_tensor_role_is_a_field():
    fields = [f for f, t in _lib.NcJob._fields_ if t is _lib.NcTensor]
    assert tuple(fields) == _lib.TENSOR_ROLES
